"""An online cost model of one engine step, fitted from the engine's own step records.

The shape is the simulator's (``kvserve/sim/cost_model.py``), made linear for a CPU that
streams weights and does the GEMMs in one pass:

    seconds ~ c0 + c1 x decode tokens + c2 x prefill tokens
              + c3 x context tokens + c4 x attention pairs + c5 x prefill chunks

``context tokens`` is the KV the step touches (sum over scheduled requests of start + new
tokens); ``attention pairs`` the (query, key) pairs attention computes (a decode: its context;
a chunk of n tokens from position s: n x s + n(n+1)/2). Decode tokens and prefill tokens get
their own per-token cost because every decode row also goes through the lm_head. A prefill
chunk also costs something of its own, whatever its length (its attention call and the mixed
step's extra work in every layer).
NOTE: why the chunk term: on the AMX Xeon the first 16 prefill tokens beside 4 decodes added
8 ms to a 21 ms step, the next 100 about 0.25 ms each (the probe ``bench/probes/mixed_step.py``,
at 25ace60); fitted without it, the per-token cost absorbed the fixed part, so small chunks
were predicted too cheap and large ones too dear.

The fit is least squares on the *relative* error (a decode step and a 512-token prefill differ
by 10x; both should be predicted well), with every coefficient kept >= 0 so a prediction grows
with every term (the planner's search needs that). It keeps the latest ``window`` records of
each kind (pure-decode steps and steps with prefill: a run of decode-only steps must not push
the prefill cost out of the fit) and refits every ``refit_every`` records, so it follows the
machine as it drifts. Pure Python: 5 unknowns, normal equations, Gaussian elimination.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.core.outputs import SchedulerOutput

NUM_FEATURES = 6
# NOTE: scales bring each feature near 1 for this engine's steps so the normal equations are
# well conditioned (pairs of a 512-token chunk: ~1.3e5; decode context of 64 streams: ~1e5).
_SCALES = (1.0, 1e-2, 1e-2, 1e-4, 1e-5, 1.0)
_RIDGE = 1e-9  # relative to the diagonal: only breaks exact collinearity


@dataclass(slots=True, frozen=True)
class StepLoad:
    """What a step computes, all the cost model needs to know about it."""

    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    num_context_tokens: int = 0
    num_attention_pairs: int = 0
    num_prefill_chunks: int = 0

    def plus_chunk(self, start_pos: int, num_tokens: int) -> StepLoad:
        """This load plus a prefill chunk of ``num_tokens`` from position ``start_pos``."""
        return StepLoad(
            self.num_decode_tokens,
            self.num_prefill_tokens + num_tokens,
            self.num_context_tokens + start_pos + num_tokens,
            self.num_attention_pairs + chunk_pairs(start_pos, num_tokens),
            self.num_prefill_chunks + (num_tokens > 0),
        )

    def features(self) -> tuple[float, ...]:
        raw = (
            1.0,
            self.num_decode_tokens,
            self.num_prefill_tokens,
            self.num_context_tokens,
            self.num_attention_pairs,
            self.num_prefill_chunks,
        )
        return tuple(v * s for v, s in zip(raw, _SCALES, strict=True))

    @classmethod
    def decodes(cls, contexts: Sequence[int]) -> StepLoad:
        """A step of one decode token per request, ``contexts`` = start_pos + 1 each."""
        total = sum(contexts)
        return cls(len(contexts), 0, total, total)

    @classmethod
    def from_record(cls, record: Mapping[str, float]) -> StepLoad:
        """From an ``LLMEngine.step_records`` entry (pairs estimated if the record lacks them)."""
        num_decode = int(record["num_decode_tokens"])
        num_prefill = int(record["num_prefill_tokens"])
        num_context = int(record["num_context_tokens"])
        pairs = record.get("num_attention_pairs")
        if pairs is None:
            # NOTE: older records: count every token against the whole context (an upper bound).
            pairs = num_context * (num_decode + num_prefill) / max(int(record["num_seqs"]), 1)
        chunks = record.get("num_prefill_chunks")
        if chunks is None:
            chunks = 1 if num_prefill else 0  # NOTE: older records: one chunk per prefill step
        return cls(num_decode, num_prefill, num_context, int(pairs), int(chunks))


def chunk_pairs(start_pos: int, num_tokens: int) -> int:
    """Attention (query, key) pairs of ``num_tokens`` new tokens after ``start_pos`` cached."""
    return num_tokens * start_pos + num_tokens * (num_tokens + 1) // 2


def step_record(sched: SchedulerOutput, seconds: float) -> dict[str, float]:
    """The load figures of one step ``sched`` that took ``seconds``: the record the engine
    keeps per step (``LLMEngine.step_records``) and the cost model is fed."""
    prefills = [r for r in sched.scheduled if len(r.token_ids) > 1]
    num_prefill = sum(len(r.token_ids) for r in prefills)
    return {
        "num_prefill_tokens": num_prefill,
        "num_decode_tokens": sched.total_num_scheduled_tokens - num_prefill,
        "num_context_tokens": sum(r.start_pos + len(r.token_ids) for r in sched.scheduled),
        "num_attention_pairs": sum(
            chunk_pairs(r.start_pos, len(r.token_ids)) for r in sched.scheduled
        ),
        "num_prefill_chunks": len(prefills),
        # NOTE: a verification's drafts are in num_prefill_tokens (1 + k positions of one
        # request); core/sched/draft_price.py tells them apart by this count.
        "num_spec_tokens": sum(len(r.spec_token_ids) for r in sched.scheduled),
        "num_seqs": len(sched.scheduled),
        "seconds": seconds,
    }


class OnlineStepCostModel:
    """Step seconds as a non-negative linear function of a :class:`StepLoad`, refitted online."""

    def __init__(self, *, window: int = 256, refit_every: int = 16, min_records: int = 4) -> None:
        for name, v in (("window", window), ("refit_every", refit_every)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if min_records < 1 or min_records > window:
            raise ValueError(f"min_records must be in [1, window={window}], got {min_records}")
        self.min_records = min_records
        self.refit_every = refit_every
        self._decode: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self._prefill: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self._since_fit = 0
        self.coefficients: tuple[float, ...] | None = None  # seconds per scaled feature
        self.num_observed = 0
        self.num_fits = 0

    @property
    def ready(self) -> bool:
        """True once both kinds of step were seen ``min_records`` times and a fit exists."""
        return self.coefficients is not None

    def observe(self, load: StepLoad, seconds: float) -> None:
        """Add one measured step; refits every ``refit_every`` records (or when first ready).

        Steps that compute nothing and non-finite or non-positive times are ignored.
        """
        if not (0.0 < seconds < math.inf):
            return
        if load.num_decode_tokens + load.num_prefill_tokens == 0:
            return
        kind = self._prefill if load.num_prefill_tokens else self._decode
        kind.append((load.features(), seconds))
        self.num_observed += 1
        self._since_fit += 1
        enough = min(len(self._decode), len(self._prefill)) >= self.min_records
        if enough and (self.coefficients is None or self._since_fit >= self.refit_every):
            self.fit()

    def fit(self) -> None:
        """Refit now on the records kept (no-op without any)."""
        rows = [*self._decode, *self._prefill]
        if not rows:
            return
        self.coefficients = _nonneg_relative_lsq(rows)
        self._since_fit = 0
        self.num_fits += 1

    def predict(self, load: StepLoad) -> float:
        """Predicted seconds of a step computing ``load``; raises RuntimeError before a fit."""
        c = self.coefficients
        if c is None:
            raise RuntimeError("the step cost model has no fit yet (check .ready)")
        return sum(ci * xi for ci, xi in zip(c, load.features(), strict=True))

    def describe(self) -> dict[str, float]:
        """The fitted costs in natural units (ms, and us per token / per 1k pairs)."""
        c = self.coefficients or (math.nan,) * NUM_FEATURES
        s = _SCALES
        return {
            "step_cost_overhead_ms": c[0] * s[0] * 1e3,
            "step_cost_decode_token_ms": c[1] * s[1] * 1e3,
            "step_cost_prefill_token_ms": c[2] * s[2] * 1e3,
            "step_cost_context_token_us": c[3] * s[3] * 1e6,
            "step_cost_kpairs_us": c[4] * s[4] * 1e9,
            "step_cost_prefill_chunk_ms": c[5] * s[5] * 1e3,
            "step_cost_records": self.num_observed,
        }


def _nonneg_relative_lsq(rows: Sequence[tuple[tuple[float, ...], float]]) -> tuple[float, ...]:
    """argmin_c sum(((x.c - y) / y)^2) with c >= 0: drop the most negative term and refit."""
    active = list(range(NUM_FEATURES))
    while True:
        sol = _solve_weighted(rows, active)
        negative = [j for j in active if sol[j] < 0.0]
        if not negative:
            return tuple(sol)
        active.remove(min(negative, key=lambda j: sol[j]))
        if not active:
            return tuple(0.0 for _ in range(NUM_FEATURES))


def _solve_weighted(
    rows: Sequence[tuple[tuple[float, ...], float]], active: list[int]
) -> list[float]:
    """Normal equations of the relative-error least squares restricted to ``active``."""
    k = len(active)
    a = [[0.0] * k for _ in range(k)]
    b = [0.0] * k
    for x, y in rows:
        w = 1.0 / (y * y)
        xs = [x[j] for j in active]
        for i in range(k):
            wi = w * xs[i]
            b[i] += wi * y
            row = a[i]
            for j in range(i, k):
                row[j] += wi * xs[j]
    for i in range(k):
        for j in range(i):
            a[i][j] = a[j][i]
        a[i][i] += _RIDGE * (a[i][i] or 1.0)
    sol = _gauss(a, b)
    out = [0.0] * NUM_FEATURES
    for j, v in zip(active, sol, strict=True):
        out[j] = v
    return out


def _gauss(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a x = b by Gaussian elimination with partial pivoting (a singular column -> 0)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            continue
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        if abs(m[i][i]) < 1e-300:
            continue
        s = m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))
        x[i] = s / m[i][i]
    return x
