"""Fit the cost model's efficiency factors to measured step times.

Each measured step gives ``seconds`` and a shape. At efficiency 1 the cost model predicts a
compute time ``F`` (FLOPs / peak) and a memory time ``B`` (bytes / bandwidth); with the
known terms ``K`` (all-reduce, swap) the model is

    seconds = max(F / eff_flops, B / eff_bandwidth) + overhead_s + K

We fit ``a = 1 / eff_flops``, ``b = 1 / eff_bandwidth`` and ``overhead_s`` by least squares on
the *relative* error (steps span orders of magnitude: a decode step and a long prefill).
The max makes it piecewise linear, so the fit alternates: assign each step to the side of the
roofline that the current parameters say binds, solve the linear least squares for that
assignment, re-assign, until the assignment is stable. It starts from a sweep of a/b ratios
and keeps the best result, so a poor local optimum is unlikely.

Record format (JSONL, one step a line), written by the engine's step timer::

    {"num_prefill_tokens": 512, "num_decode_tokens": 3, "num_context_tokens": 1600,
     "num_seqs": 4, "seconds": 0.41}

(optional ``num_attention_pairs``: exact attention work; else it is estimated.)
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvserve.sim.cost_model import CostModel, Efficiency, StepShape
from kvserve.sim.workloads import read_jsonl

PRIOR_WEIGHT = 1e-6


@dataclass(slots=True, frozen=True)
class StepRecord:
    """One measured engine step."""

    num_prefill_tokens: int
    num_decode_tokens: int
    num_context_tokens: int
    num_seqs: int
    seconds: float
    num_attention_pairs: int | None = None

    def __post_init__(self) -> None:
        for f in ("num_prefill_tokens", "num_decode_tokens", "num_context_tokens", "num_seqs"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"StepRecord.{f} must be an int >= 0, got {v!r}")
        if not (isinstance(self.seconds, (int, float)) and 0 < self.seconds < math.inf):
            raise ValueError(
                f"StepRecord.seconds must be a finite number > 0, got {self.seconds!r}"
            )

    def shape(self) -> StepShape:
        return StepShape(
            num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=self.num_decode_tokens,
            num_context_tokens=self.num_context_tokens,
            num_seqs=self.num_seqs,
            num_attention_pairs=self.num_attention_pairs,
        )


def load_step_records(path: str | Path) -> list[StepRecord]:
    """Read StepRecords from JSONL; raises ValueError naming the bad line."""
    return read_jsonl(path, lambda d, _index: StepRecord(**d), "step record")


def save_step_records(path: str | Path, records: Iterable[StepRecord]) -> None:
    """Write StepRecords as JSONL (the format :func:`load_step_records` reads)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            d = {k: v for k, v in asdict(r).items() if v is not None}
            f.write(json.dumps(d) + "\n")


@dataclass(frozen=True)
class FitResult:
    """Fitted efficiency and how well it explains the measurements."""

    efficiency: Efficiency
    num_records: int
    num_compute_bound: int
    num_memory_bound: int
    rms_rel_error: float  # sqrt(mean(((pred - y) / y)^2))
    max_rel_error: float
    mean_abs_rel_error: float
    # False when no record landed on that side of the roofline: the factor is then the prior.
    flops_identified: bool
    bandwidth_identified: bool

    def summary(self) -> str:
        e = self.efficiency
        return (
            f"fit over {self.num_records} steps ({self.num_compute_bound} compute-bound, "
            f"{self.num_memory_bound} memory-bound): eff_flops={e.flops:.3f}"
            f"{'' if self.flops_identified else ' (prior)'} "
            f"eff_bandwidth={e.bandwidth:.3f}{'' if self.bandwidth_identified else ' (prior)'} "
            f"overhead={e.overhead_s * 1e3:.3f} ms; relative error rms {self.rms_rel_error:.1%}, "
            f"mean |.| {self.mean_abs_rel_error:.1%}, max {self.max_rel_error:.1%}"
        )


def _roofline_terms(
    cost_model: CostModel, records: Sequence[StepRecord]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    hw = cost_model.hardware
    f = np.empty(len(records))
    b = np.empty(len(records))
    k = np.empty(len(records))
    y = np.empty(len(records))
    for i, r in enumerate(records):
        s = r.shape()
        f[i] = cost_model.flops_per_gpu(s) / hw.peak_flops
        b[i] = cost_model.bytes_per_gpu(s) / hw.memory_bandwidth
        k[i] = cost_model.allreduce_time(s)
        y[i] = r.seconds
    return f, b, k, y


def _solve(
    f: np.ndarray,
    b: np.ndarray,
    z: np.ndarray,
    w: np.ndarray,
    on_compute: np.ndarray,
    prior: Efficiency,
) -> np.ndarray:
    """Weighted non-negative least squares for z ~ a*f*[c] + b*b*[m] + c (3 unknowns).

    NOTE: two weak pseudo-observations pull a and b towards the prior (relative deviation,
    weight PRIOR_WEIGHT): data that cannot tell the two sides apart (e.g. decode steps only,
    where FLOPs and bytes both grow with the batch) then keep the prior instead of landing on
    an arbitrary point of the exact-fit manifold. Informative data moves the fit by ~1e-6.
    """
    sw = math.sqrt(PRIOR_WEIGHT)
    cols = np.stack([f * on_compute, b * ~on_compute, np.ones_like(f)], axis=1) * w[:, None]
    cols = np.vstack([cols, [[sw * prior.flops, 0.0, 0.0], [0.0, sw * prior.bandwidth, 0.0]]])
    target = np.concatenate([z * w, [sw, sw]])
    best = np.zeros(3)
    best_err = math.inf
    # NOTE: 3 unknowns: enumerating the active sets is exact NNLS and cheaper than a solver.
    for mask in range(1, 8):
        idx = [j for j in range(3) if mask >> j & 1]
        sol, *_ = np.linalg.lstsq(cols[:, idx], target, rcond=None)
        if np.any(sol < 0):
            continue
        x = np.zeros(3)
        x[idx] = sol
        err = float(np.sum((cols @ x - target) ** 2))
        if err < best_err:
            best, best_err = x, err
    return best


def fit_efficiency(
    records: Sequence[StepRecord],
    cost_model: CostModel,
    *,
    max_iters: int = 50,
) -> FitResult:
    """Least-squares efficiency factors for ``cost_model``'s model and hardware.

    Sides of the roofline with no record keep the cost model's current (prior) factor.
    Raises ValueError with fewer than 3 records.
    """
    if len(records) < 3:
        raise ValueError(f"need at least 3 step records to fit 3 parameters, got {len(records)}")
    f, bmem, k, y = _roofline_terms(cost_model, records)
    z = y - k
    w = 1.0 / y
    prior = cost_model.efficiency
    best: _Candidate | None = None
    for log_ratio in np.linspace(-4, 4, 33):
        cand = _alternate(f, bmem, z, w, f * 10.0**log_ratio >= bmem, prior, max_iters)
        if best is None or cand.err < best.err:
            best = cand
    assert best is not None
    eff = Efficiency(flops=1.0 / best.a, bandwidth=1.0 / best.b, overhead_s=best.c)
    pred = np.maximum(best.a * f, best.b * bmem) + best.c + k
    rel = (pred - y) / y
    return FitResult(
        efficiency=eff,
        num_records=len(records),
        num_compute_bound=int(best.on_compute.sum()),
        num_memory_bound=int((~best.on_compute).sum()),
        rms_rel_error=float(np.sqrt(np.mean(rel**2))),
        max_rel_error=float(np.max(np.abs(rel))),
        mean_abs_rel_error=float(np.mean(np.abs(rel))),
        flops_identified=best.a_fitted,
        bandwidth_identified=best.b_fitted,
    )


@dataclass
class _Candidate:
    err: float
    a: float
    b: float
    c: float
    on_compute: np.ndarray
    a_fitted: bool
    b_fitted: bool


def _alternate(
    f: np.ndarray,
    bmem: np.ndarray,
    z: np.ndarray,
    w: np.ndarray,
    on_compute: np.ndarray,
    prior: Efficiency,
    max_iters: int,
) -> _Candidate:
    """Alternate roofline-side assignment and linear least squares from one start."""
    for _ in range(max_iters):
        x = _solve(f, bmem, z, w, on_compute, prior)
        a_fitted = bool(on_compute.any() and x[0] > 0)
        b_fitted = bool((~on_compute).any() and x[1] > 0)
        a = float(x[0]) if a_fitted else 1.0 / prior.flops
        b = float(x[1]) if b_fitted else 1.0 / prior.bandwidth
        new_assign = a * f >= b * bmem
        if np.array_equal(new_assign, on_compute):
            break
        on_compute = new_assign
    pred = np.maximum(a * f, b * bmem) + x[2]
    penalty = (a * prior.flops - 1) ** 2 + (b * prior.bandwidth - 1) ** 2
    err = float(np.sum(((pred - z) * w) ** 2)) + PRIOR_WEIGHT * penalty
    return _Candidate(err, a, b, float(x[2]), on_compute, a_fitted, b_fitted)
