"""Batch-invariant selection: one method per weight shape for every M, among the candidates
whose rows do not depend on the other rows of the call (``choose_invariant``).

Why: the per-bucket choice (``choose.choose``) may run a shape through one kernel at 8 rows and
another at 256, and kernels compute different bits: the int8-dot kernels quantize activations
per block of 32, a dense copy does not; MKL's sgemm runs M <= 9 through other paths than
larger M (measured on the Zen 3 EPYC, torch 2.13, 2 threads: rows of ``torch.mm(A[:m], W)``
differ from those of ``torch.mm(A, W)`` at m = 1, 2, 3, 5, 7, 9; oneDNN prepacked matched at
every m tried, 1-2048). A token's logits then depend on how many rows its step had, which
chunk of its prompt it fell in, and whether its KV came from the prefix cache (issue 50).

So under batch invariance (the default, ``--batch-invariant``) a shape keeps one method, and
only a method that passes ``rows_invariant`` on this CPU, at the engine's thread count: each
row of a call equals that row computed alone and in calls of other sizes, bit for bit. Among
those the one with the least summed time relative to each bucket's fastest candidate wins;
a method holding its own copy of the weight must beat the best source-sharing one by the copy
margin. Only the schedule inside that method may then vary with M (its tiles), never the
numerics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import torch

from kvserve.runtime.autotune.candidates import CandidateFactory, candidate_methods
from kvserve.runtime.autotune.measure import Timing
from kvserve.runtime.linear import M_MAX, LinearMethod

log = logging.getLogger(__name__)

# The row counts a probe compares against the full call: every tile tail of 4, 8, 16 and 32
# rows, the sizes where MKL changes path, and prefill sizes.
PROBE_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 65, 129, 256)
# The full call's rows (capped by a shape's largest M).
FULL_ROWS = 320
# The rows each also computed alone: one row is where libraries switch to a gemv kernel.
# NOTE: 32, not 1: torch.mm in bf16 (AMD EPYC Zen 4, 576x1536) differed from its batched rows
# in 5-10 % of single rows, so a probe of one or two rows passed it by luck.
SINGLE_ROWS = 32

Shape = tuple[int, int]


def rows_invariant(
    method: LinearMethod,
    act_dtype: torch.dtype,
    device: torch.device,
    max_rows: int = M_MAX,
    seed: int = 0,
) -> bool:
    """Whether every row of ``method``'s output is the same bits whatever the other rows of
    the call: rows ``[0, m)`` of a call on ``m`` rows and rows ``[r, r + m)`` of a call that
    starts at row ``r`` against the same rows of one call on ``min(FULL_ROWS, max_rows)``,
    and each of the first ``SINGLE_ROWS`` rows alone.
    """
    full_rows = max(1, min(FULL_ROWS, max_rows))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(full_rows, method.in_features, generator=gen).to(device=device, dtype=act_dtype)
    with torch.inference_mode():
        full = method.apply(x).clone()
        for m in (r for r in PROBE_ROWS if r < full_rows):
            if not torch.equal(method.apply(x[:m].clone()), full[:m]):
                return False
            start = (full_rows - m) // 2
            if start and not torch.equal(
                method.apply(x[start : start + m].clone()), full[start : start + m]
            ):
                return False
        for i in range(min(SINGLE_ROWS, full_rows)):
            if not torch.equal(method.apply(x[i : i + 1].clone()), full[i : i + 1]):
                return False
    return True


def choose_invariant(
    timings: Sequence[Timing],
    weights: Mapping[Shape, object],
    *,
    act_dtype: torch.dtype,
    device: torch.device,
    buckets: Sequence[tuple[int, int]],
    max_rows: Mapping[Shape, int] | None = None,
    factories: Sequence[CandidateFactory] | None = None,
    margin: float = 0.05,
    probe: Callable[[LinearMethod, torch.dtype, torch.device, int], bool] = rows_invariant,
) -> dict[Shape, list[tuple[int, str]]]:
    """The plan (see the module docstring): per shape of ``weights``, one method for every
    bucket. A shape with no row-invariant candidate keeps its per-bucket fastest (logged as
    a warning: its outputs may then depend on the batch)."""
    plan: dict[Shape, list[tuple[int, str]]] = {}
    for shape, weight in weights.items():
        ranked = _ranked(timings, shape, margin)
        limit = (max_rows or {}).get(shape, M_MAX)
        methods = {
            m.name: m
            for m in candidate_methods(
                weight, act_dtype=act_dtype, device=device, factories=factories
            )
        }
        chosen = None
        for name in ranked:
            method = methods.get(name)
            if method is None:
                continue
            method.prepare()
            if probe(method, act_dtype, device, limit):
                chosen = name
                break
            log.debug(
                "kernel %s for %s: rows depend on the batch, not batch-invariant", name, shape
            )
        methods.clear()
        if chosen is None:
            log.warning(
                "no batch-invariant kernel for the %dx%d projection: its outputs may depend "
                "on the batch",
                *shape,
            )
            chosen = ranked[0] if ranked else None
        if chosen is not None:
            plan[shape] = [(max_m, chosen) for max_m, _ in buckets]
    return plan


def _ranked(timings: Sequence[Timing], shape: Shape, margin: float) -> list[str]:
    """The candidates of ``shape`` timed in every bucket it was measured in, best first by
    summed time relative to each bucket's fastest (a copy-holding one's score counts
    ``1 / (1 - margin)`` times its own, so it must win by the margin)."""
    cells: dict[int, dict[str, float]] = {}
    sharing: dict[str, bool] = {}
    for t in timings:
        if (t.out_features, t.in_features) != shape:
            continue
        cell = cells.setdefault(t.max_m, {})
        if t.seconds is not None:
            cell[t.candidate] = t.seconds
            sharing[t.candidate] = t.shares_source
    if not cells:
        return []
    names = [n for n in sharing if all(n in cell for cell in cells.values())]
    scores = {}
    for name in names:
        score = sum(cell[name] / min(cell.values()) for cell in cells.values())
        scores[name] = score if sharing[name] else score / (1.0 - margin)
    return sorted(names, key=lambda n: scores[n])
