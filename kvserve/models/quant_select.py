"""Kernel selection for quantized projections: the int8-dot kernel or a dense copy, per M.

The engine's selection (``kernel_select.select_kernels``) times the dense candidates on
random dense weights before the model is read. A model that holds quantized weights also
gets this one: per projection shape, random weights in the model's own block format run
through ``quantized_candidates`` (the kernel, and ``dequant_{dtype}``: a dense copy, which
must beat the kernel by ``margin`` to pay for its memory), timed with the same ``measure``
and chosen with the same ``choose`` per M bucket. NOTE: not cached (about 2 s on the
embedded model's five shapes); the timings do not depend on the weights' values.
"""

from __future__ import annotations

from typing import Any

import torch

from kvserve.models.quant import QuantizedWeight, quantize_dense
from kvserve.models.quant_linear import kernel_layout, quantized_candidates
from kvserve.runtime.kernel_select import DECODE_BOUNDS, choose, m_buckets, measure
from kvserve.runtime.linear import LinearPlan


def quantized_shapes(model: Any) -> dict[tuple[int, int], str]:
    """(out, in) of the model's single-format quantized projections -> their format."""
    shapes: dict[tuple[int, int], str] = {}
    sources = [model.quantized.get("lm_head")]
    sources += [s for layer in model.layers for s in layer.quantized.values()]
    for source in sources:
        if isinstance(source, QuantizedWeight):
            shapes.setdefault(source.shape, source.qtype)
    return shapes


def select_quantized_kernels(
    model: Any,
    *,
    act_dtype: torch.dtype,
    device: torch.device | str = "cpu",
    mode: str = "auto",
    margin: float = 0.05,
    budget_s: float = 0.010,
) -> LinearPlan:
    """The chosen quantized method per shape and M bucket (empty when ``mode`` is "off" or
    the model holds no quantized projection)."""
    shapes = quantized_shapes(model)
    if mode == "off" or not shapes:
        return {}
    gen = torch.Generator().manual_seed(2)
    weights = {
        shape: kernel_layout(quantize_dense(torch.randn(shape, generator=gen) * 0.02, qtype))
        for shape, qtype in shapes.items()
    }
    head = model.quantized.get("lm_head")
    max_rows = {head.shape: DECODE_BOUNDS[-1]} if head is not None else None
    timings = measure(
        weights,
        act_dtype=act_dtype,
        device=torch.device(device),
        buckets=m_buckets(),
        max_rows=max_rows,
        factories=[quantized_candidates],
        budget_s=budget_s,
    )
    return choose(timings, m_buckets(), margin=margin)


def with_quantized_plan(
    model: Any,
    plan: LinearPlan | None,
    *,
    act_dtype: torch.dtype,
    device: torch.device | str = "cpu",
    mode: str = "auto",
) -> LinearPlan | None:
    """``plan`` (the dense selection; None = the default methods) plus the quantized
    projections' choices (``select_quantized_kernels``); None stays None when there are
    none (every quantized projection then runs its first candidate, the kernel)."""
    quant = select_quantized_kernels(model, act_dtype=act_dtype, device=device, mode=mode)
    if not quant:
        return plan
    return {**(plan or {}), **quant}
