"""Select: the flow for one kind of weight, dense or quantized, at one dtype: the cache,
else measure, choose and check, then write the cache.

``select_kernels`` times the dense candidates on random dense weights of the model's shapes
(before the model is read). ``quantized_selection`` does the same for a model's quantized
projections: per shape, random weights in the model's own block format and layout
(``QuantizedProjections.make_source``) run through the quantized kernels' factory (the
int8-dot kernel, and ``dequant_{dtype}``: a dense copy, which must beat the kernel by
``margin`` to pay for its memory); the timings do not depend on the weights' values. Its
record sits beside the dense one, keyed as the dense one is plus each shape's block format
and layout and the quantized kernels' build (source hash): 10.8-11.3 s of measurement on the
embedded model's five shapes at the first start-up on the AMX Xeon (2026-12-06, 8cf973a; git
show 25ace60:bench/results/session30/step_check_runs_final.txt; the step check included),
nothing after.

Modes: ``off`` (no measurement: ``torch.mm`` everywhere, the original path), ``auto`` (the
cache, else measure) and ``measure`` (always measure, then refresh the cache); a choice
measured on a busy machine is measured again on a quieter one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

from kvserve.runtime import native
from kvserve.runtime.autotune.cache import (
    cache_key,
    cache_path,
    load_cached,
    machine_load,
    measured_under_load,
    save_cached,
)
from kvserve.runtime.autotune.candidates import (
    DECODE_BOUNDS,
    CandidateFactory,
    QuantizedProjections,
    check_mode,
    m_buckets,
    registered_factories,
)
from kvserve.runtime.autotune.check import step_check
from kvserve.runtime.autotune.choose import Selection, choose
from kvserve.runtime.autotune.invariant import choose_invariant
from kvserve.runtime.autotune.measure import Timer, Timing, measure, wall_timer
from kvserve.runtime.native import quant_ops

log = logging.getLogger(__name__)
# Bumped when the quantized candidates change (the cache then measures again).
# 2: dequant_tile_*; 3: dequant_onednn_*; 4: *_x16_amx_bf16; 5: int8_amx
QUANT_CANDIDATES_VERSION = 5


def select_kernels(
    shapes: Iterable[tuple[int, int]],
    *,
    act_dtype: torch.dtype,
    device: torch.device | str = "cpu",
    mode: str = "auto",
    max_rows: Mapping[tuple[int, int], int] | None = None,
    timer: Timer = wall_timer,
    factories: Sequence[CandidateFactory] | None = None,
    directory: Path | None = None,
    margin: float = 0.05,
    budget_s: float = 0.010,
    counts: Mapping[tuple[int, int], int] | None = None,
    batch_invariant: bool = False,
) -> Selection:
    """Choose a method per weight shape and M bucket (see the module docstring).

    ``shapes``: the (out, in) of every distinct projection weight; the candidates run on
    random weights of those shapes (timings do not depend on the values), so this can run
    before the model's weights are loaded. ``counts``: the calls a decode step makes of each
    shape, in step order (layers; the lm_head once); given, the decode buckets' choices are
    checked on whole steps (``check.step_check``). ``batch_invariant``: one row-invariant
    method per shape for every M (``invariant.choose_invariant``; no step check). Raises
    ValueError for an unknown ``mode``.
    """
    check_mode(mode)
    device = torch.device(device)
    shapes = list(dict.fromkeys(tuple(s) for s in shapes))
    if mode == "off":
        return Selection(act_dtype, {}, source="off")
    facs = list(factories) if factories is not None else list(registered_factories())
    buckets = m_buckets()
    key = cache_key(
        act_dtype=act_dtype,
        device=device,
        shapes=shapes,
        buckets=buckets,
        max_rows=max_rows,
        factories=facs,
        counts=counts,
    )
    key["batch_invariant"] = batch_invariant
    path = cache_path(key, directory)
    load = machine_load()
    if mode == "auto":
        cached = load_cached(path, key, act_dtype)
        if cached is not None and measured_under_load(cached.load, load):
            log.debug(
                "kernel selection cache %s was measured at load %.1f per CPU (now %.1f): "
                "measuring again",
                path,
                cached.load,
                load,
            )
        elif cached is not None:
            return cached
    t0 = time.perf_counter()
    gen = torch.Generator(device="cpu").manual_seed(1)
    weights = {
        s: (torch.randn(s[1], s[0], generator=gen).t() * 0.02).to(device=device, dtype=act_dtype)
        for s in shapes
    }  # [out, in] views of [in, out] storage: the model's layout (models/decoder_layer.py)
    skipped: dict[str, str] = {}
    timings = measure(
        weights,
        act_dtype=act_dtype,
        device=device,
        buckets=buckets,
        max_rows=max_rows,
        timer=timer,
        factories=facs,
        skipped=skipped,
        budget_s=budget_s,
    )
    plan, checks = _plan(
        weights, counts, timings, act_dtype, device, facs, max_rows, margin, batch_invariant
    )
    sel = Selection(
        act_dtype, plan, timings, skipped, "measured", time.perf_counter() - t0, load, checks
    )
    save_cached(path, key, sel)
    return sel


def quantized_cache_key(
    quantized: QuantizedProjections,
    *,
    act_dtype: torch.dtype,
    device: torch.device,
    max_rows: dict[tuple[int, int], int] | None,
    counts: dict[tuple[int, int], int] | None = None,
    batch_invariant: bool = False,
) -> dict[str, object]:
    """The dense selection's cache key plus the formats, layouts and the kernels' build."""
    formats = quantized.formats
    key = cache_key(
        act_dtype=act_dtype,
        device=device,
        shapes=formats.keys(),
        buckets=m_buckets(),
        max_rows=max_rows,
        factories=[quantized.factory],
        counts=counts,
    )
    key["quantized"] = sorted([o, i, q, lay] for (o, i), (q, lay) in formats.items())
    key["quant_kernels"] = quant_ops.build_name() if quant_ops.available() else None
    # NOTE: int8_amx runs in the `kvserve` op library (native/csrc/amx_int8.cpp), not this one.
    key["native_kernels"] = native.build_name() if native.available() else None
    key["quant_candidates"] = QUANT_CANDIDATES_VERSION
    key["batch_invariant"] = batch_invariant
    return key


def quantized_selection(
    quantized: QuantizedProjections,
    *,
    head_shape: tuple[int, int] | None,
    act_dtype: torch.dtype,
    device: torch.device | str = "cpu",
    mode: str = "auto",
    margin: float = 0.05,
    budget_s: float = 0.010,
    directory: Path | None = None,
    batch_invariant: bool = False,
) -> Selection:
    """The quantized projections' selection (see the module docstring). ``head_shape``: the
    lm_head's, measured up to the decode sizes only. With ``quantized.counts`` the decode
    buckets' choices are checked on whole steps (``check.step_check``); ``batch_invariant``:
    as in ``select_kernels``. An empty plan
    (source "off") when ``mode`` is "off" or nothing is quantized."""
    formats = quantized.formats
    if mode == "off" or not formats:
        return Selection(act_dtype, {}, source="off")
    device = torch.device(device)
    max_rows = {head_shape: DECODE_BOUNDS[-1]} if head_shape is not None else None
    step = {s: n for s, n in quantized.counts.items() if s in formats} or None
    key = quantized_cache_key(
        quantized,
        act_dtype=act_dtype,
        device=device,
        max_rows=max_rows,
        counts=step,
        batch_invariant=batch_invariant,
    )
    path = cache_path(key, directory)
    load = machine_load()
    if mode == "auto":
        cached = load_cached(path, key, act_dtype)
        if cached is not None and not measured_under_load(cached.load, load):
            log.debug("quantized kernels from cache %s", path)
            return cached
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(2)
    weights = {
        shape: quantized.make_source(torch.randn(shape, generator=gen) * 0.02, qtype, layout)
        for shape, (qtype, layout) in formats.items()
    }
    factories = [quantized.factory]
    timings = measure(
        weights,
        act_dtype=act_dtype,
        device=torch.device(device),
        buckets=m_buckets(),
        max_rows=max_rows,
        factories=factories,
        budget_s=budget_s,
    )
    plan, checks = _plan(
        weights, step, timings, act_dtype, device, factories, max_rows, margin, batch_invariant
    )
    seconds = time.perf_counter() - t0
    sel = Selection(act_dtype, plan, timings, {}, "measured", seconds, load, checks)
    save_cached(path, key, sel)
    log.debug("quantized %s", sel.summary())
    return sel


def _plan(
    weights: Mapping[tuple[int, int], object],
    counts: Mapping[tuple[int, int], int] | None,
    timings: list[Timing],
    act_dtype: torch.dtype,
    device: torch.device,
    factories: Sequence[CandidateFactory],
    max_rows: Mapping[tuple[int, int], int] | None,
    margin: float,
    batch_invariant: bool,
) -> tuple[dict[tuple[int, int], list[tuple[int, str]]], list[dict[str, object]]]:
    """The plan from the timings and the step check's records: per bucket (``choose``, then
    ``step_check``), or, batch-invariant, one row-invariant method per shape."""
    if batch_invariant:
        plan = choose_invariant(
            timings,
            weights,
            act_dtype=act_dtype,
            device=device,
            buckets=m_buckets(),
            max_rows=max_rows,
            factories=factories,
            margin=margin,
        )
        return plan, []
    plan = choose(timings, m_buckets(), margin=margin)
    return step_check(
        weights, counts, plan, timings, act_dtype, device, factories, max_rows, margin
    )
