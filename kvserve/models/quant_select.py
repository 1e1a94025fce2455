"""What kernel selection needs of a model's quantized projections, read from the model.

Kernel selection (``kvserve.runtime.autotune``) knows nothing of the block formats: it takes
a ``QuantizedProjections`` (``quantized_projections``): each single-format quantized
projection's (out, in) -> (format, layout), the calls a decode step makes of each shape, how
to make a random weight of a format and layout (``kernel_source``) and the quantized kernels'
candidate factory (``quant_linear.quantized_candidates``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvserve.models.quant import QuantizedWeight, quantize_dense
from kvserve.models.quant_linear import kernel_layout, quantized_candidates
from kvserve.runtime.autotune import QuantizedProjections
from kvserve.runtime.autotune.select import quantized_selection
from kvserve.runtime.linear import LinearPlan


def quantized_shapes(model: Any) -> dict[tuple[int, int], str]:
    """(out, in) of the model's single-format quantized projections -> their format."""
    return {shape: qtype for shape, (qtype, _) in quantized_formats(model).items()}


def quantized_formats(model: Any) -> dict[tuple[int, int], tuple[str, str]]:
    """(out, in) of the model's single-format quantized projections -> (format, layout)."""
    shapes: dict[tuple[int, int], tuple[str, str]] = {}
    sources = [model.quantized.get("lm_head")]
    sources += [s for layer in model.layers for s in layer.quantized.values()]
    for source in sources:
        if isinstance(source, QuantizedWeight):
            shapes.setdefault(source.shape, (source.qtype, source.layout))
    return shapes


def quantized_counts(model: Any) -> dict[tuple[int, int], int]:
    """How many calls a decode step makes of each single-format quantized projection shape,
    in step order (the layers', then the lm_head's)."""
    counts: dict[tuple[int, int], int] = {}
    sources = [s for layer in model.layers for s in layer.quantized.values()]
    for source in [*sources, model.quantized.get("lm_head")]:
        if isinstance(source, QuantizedWeight):
            counts[source.shape] = counts.get(source.shape, 0) + 1
    return counts


def kernel_source(dense: torch.Tensor, qtype: str, layout: str) -> object:
    """``dense`` [out, in] quantized to ``qtype`` in ``layout``, as the model holds it."""
    return kernel_layout(quantize_dense(dense, qtype), layout)


def projections_for(
    formats: Mapping[tuple[int, int], tuple[str, str]], counts: Mapping[tuple[int, int], int]
) -> QuantizedProjections:
    """The ``QuantizedProjections`` of these formats and step counts."""
    return QuantizedProjections(dict(formats), dict(counts), kernel_source, quantized_candidates)


def quantized_projections(model: Any) -> QuantizedProjections:
    """What kernel selection needs of ``model``'s quantized projections (see the module
    docstring); empty formats when it holds none."""
    return projections_for(quantized_formats(model), quantized_counts(model))


def select_quantized_kernels(
    model: Any,
    *,
    act_dtype: torch.dtype,
    device: torch.device | str = "cpu",
    mode: str = "auto",
    margin: float = 0.05,
    budget_s: float = 0.010,
    directory: Path | None = None,
) -> LinearPlan:
    """The chosen quantized method per shape and M bucket (empty when ``mode`` is "off" or
    the model holds no quantized projection), through ``autotune.select.quantized_selection``
    (``directory`` overrides the cache directory)."""
    head = model.quantized.get("lm_head")
    return quantized_selection(
        quantized_projections(model),
        head_shape=head.shape if head is not None else None,
        act_dtype=act_dtype,
        device=device,
        mode=mode,
        margin=margin,
        budget_s=budget_s,
        directory=directory,
    ).plan
