"""Kernel selection for quantized projections: the int8-dot kernel or a dense copy, per M.

The engine's selection (``kernel_select.select_kernels``) times the dense candidates on
random dense weights before the model is read. A model that holds quantized weights also
gets this one: per projection shape, random weights in the model's own block format run
through ``quantized_candidates`` (the kernel, and ``dequant_{dtype}``: a dense copy, which
must beat the kernel by ``margin`` to pay for its memory), timed with the same ``measure``
and chosen with the same ``choose`` per M bucket; the timings do not depend on the weights'
values. The choice is cached beside the dense one (``kernel_cache.cache_dir()``), keyed as
the dense one is (CPU, flags, torch, threads, dtype, shapes, buckets, candidates) plus each
shape's block format and layout and the quantized kernels' build (source hash): 10.8-11.3 s
of measurement on the embedded model's five shapes at the first start-up on the AMX Xeon
(``bench/results/session30/step_check_runs_final.txt``; the step check of ``plan_check``,
given the calls a step makes of each shape, ``quantized_counts``, included), nothing after.
The same rules as the dense cache: ``mode="measure"`` always measures and refreshes it, and
a choice measured on a busy machine is measured again on a quieter one.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from kvserve.models.quant import QuantizedWeight, quantize_dense
from kvserve.models.quant_linear import kernel_layout, quantized_candidates
from kvserve.runtime import native
from kvserve.runtime.kernel_cache import cache_key, cache_path, machine_load, measured_under_load
from kvserve.runtime.kernel_select import (
    DECODE_BOUNDS,
    Selection,
    choose,
    load_cached,
    m_buckets,
    measure,
    save_cached,
)
from kvserve.runtime.linear import LinearPlan
from kvserve.runtime.native import quant_ops
from kvserve.runtime.plan_check import step_check

log = logging.getLogger(__name__)
# Bumped when the quantized candidates change (the cache then measures again).
# 2: dequant_tile_*; 3: dequant_onednn_*; 4: *_x16_amx_bf16; 5: int8_amx
QUANT_CANDIDATES_VERSION = 5


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


def quantized_cache_key(
    formats: dict[tuple[int, int], tuple[str, str]],
    *,
    act_dtype: torch.dtype,
    device: torch.device,
    max_rows: dict[tuple[int, int], int] | None,
    counts: dict[tuple[int, int], int] | None = None,
) -> dict[str, object]:
    """The dense selection's cache key plus the formats, layouts and the kernels' build."""
    key = cache_key(
        act_dtype=act_dtype,
        device=device,
        shapes=formats.keys(),
        buckets=m_buckets(),
        max_rows=max_rows,
        factories=[quantized_candidates],
        counts=counts,
    )
    key["quantized"] = sorted([o, i, q, lay] for (o, i), (q, lay) in formats.items())
    key["quant_kernels"] = quant_ops.build_name() if quant_ops.available() else None
    # NOTE: int8_amx runs in the `kvserve` op library (kvserve_amx_int8.cpp), not this one.
    key["native_kernels"] = native.build_name() if native.available() else None
    key["quant_candidates"] = QUANT_CANDIDATES_VERSION
    return key


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
    the model holds no quantized projection); from the cache under ``mode="auto"`` (see the
    module docstring; ``directory`` overrides the cache directory)."""
    head = model.quantized.get("lm_head")
    return quantized_selection(
        quantized_formats(model),
        counts=quantized_counts(model),
        head_shape=head.shape if head is not None else None,
        act_dtype=act_dtype,
        device=device,
        mode=mode,
        margin=margin,
        budget_s=budget_s,
        directory=directory,
    ).plan


def quantized_selection(
    formats: dict[tuple[int, int], tuple[str, str]],
    *,
    head_shape: tuple[int, int] | None,
    act_dtype: torch.dtype,
    device: torch.device | str = "cpu",
    mode: str = "auto",
    margin: float = 0.05,
    budget_s: float = 0.010,
    directory: Path | None = None,
    counts: dict[tuple[int, int], int] | None = None,
) -> Selection:
    """The quantized projections' selection (see the module docstring), given by their (out,
    in) -> (format, layout) (``quantized_formats``) rather than by a model. ``head_shape``:
    the lm_head's, measured up to the decode sizes only. ``counts``: the calls a decode step
    makes of each shape, in step order; given, the decode buckets' choices are checked on
    whole steps (``plan_check.step_check``). An empty plan (source "off") when ``mode`` is
    "off" or nothing is quantized."""
    if mode == "off" or not formats:
        return Selection(act_dtype, {}, source="off")
    device = torch.device(device)
    max_rows = {head_shape: DECODE_BOUNDS[-1]} if head_shape is not None else None
    step = {s: n for s, n in (counts or {}).items() if s in formats} or None
    key = quantized_cache_key(
        formats, act_dtype=act_dtype, device=device, max_rows=max_rows, counts=step
    )
    path = cache_path(key, directory)
    load = machine_load()
    if mode == "auto":
        cached = load_cached(path, key, act_dtype)
        if cached is not None and not measured_under_load(cached.load, load):
            log.info("quantized kernels from cache %s", path)
            return cached
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(2)
    weights = {
        shape: kernel_layout(
            quantize_dense(torch.randn(shape, generator=gen) * 0.02, qtype), layout
        )
        for shape, (qtype, layout) in formats.items()
    }
    timings = measure(
        weights,
        act_dtype=act_dtype,
        device=torch.device(device),
        buckets=m_buckets(),
        max_rows=max_rows,
        factories=[quantized_candidates],
        budget_s=budget_s,
    )
    plan = choose(timings, m_buckets(), margin=margin)
    plan, checks = step_check(
        weights, step, plan, timings, act_dtype, device, [quantized_candidates], max_rows, margin
    )
    seconds = time.perf_counter() - t0
    sel = Selection(act_dtype, plan, timings, {}, "measured", seconds, load, checks)
    save_cached(path, key, sel)
    log.info("quantized %s", sel.summary())
    return sel
