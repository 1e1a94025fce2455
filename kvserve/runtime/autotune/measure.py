"""Measure: each candidate kernel's time per weight shape and M bucket.

For every distinct weight shape of the model (qkv, o, gate/up, down, lm_head) and every M
bucket (``candidates.m_buckets``: decode sizes 1, 2-8, 9-16, 17-32, 33-128, then prefill
chunks of 129-256 and above, probed at 256 and 512 rows), each candidate that the factories
offer (``candidates.candidate_methods``) runs on random data of that shape: the candidates
take turns (interleaved, so a burst of load on a shared machine hits all of them), each is
timed for a few milliseconds on weights cold in the caches (each call reads another copy, as
each layer of the model does), and its best time counts (``Timing``). A candidate that
raises is skipped with the reason recorded. ``choose`` then picks per bucket.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvserve.runtime.autotune.candidates import CandidateFactory, candidate_methods
from kvserve.runtime.linear import M_MAX, LinearMethod

log = logging.getLogger(__name__)

# NOTE: the weight bytes a timing rotates through: more than the last-level cache holds of
# them (the AMX Xeon's VM, qkv 960x576 at M=20, torch.mm / oneDNN us a call: one copy 61 / 45,
# 32 MB of copies 66 / 50, 64 MB 94 / 57, 128 MB 109 / 80; 64 MB already ranks them as the
# model's step does, at half the start-up time and memory of 128).
COLD_BYTES = 64 << 20
MAX_COPIES = 256
# NOTE: what one shape's copies may hold, all candidates together: quantized sources carry
# dense candidates 3-6x their size, and 256 copies of each made a 3.9 GB start-up peak.
HELD_BYTES = 256 << 20
_HOT_BYTES = 64 << 10  # below this, a call's fixed cost outweighs its read: one copy
# A candidate slower than this many times a cell's fastest stops being timed there (its
# first calls counted): neither ``choose`` nor the step check (``check.TOLERANCE``)
# would take it.
SITS_OUT = 2.0

# A function that returns the seconds of one call of ``method`` on ``x`` into ``out``.
Timer = Callable[[LinearMethod, torch.Tensor, torch.Tensor], float]


@dataclass(frozen=True)
class Timing:
    """One candidate at one shape and bucket: its best seconds per call (None: it failed)."""

    out_features: int
    in_features: int
    max_m: int
    probe_m: int
    candidate: str
    seconds: float | None
    weight_bytes: int
    error: str = ""
    shares_source: bool = False  # the method reads the model's weight (holds no copy)

    @property
    def gbytes_per_s(self) -> float:
        """Weight bytes read per second (the decode figure of merit)."""
        return self.weight_bytes / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def gflops(self) -> float:
        """GFLOP/s (the prefill figure of merit)."""
        if not self.seconds:
            return 0.0
        return 2.0 * self.probe_m * self.out_features * self.in_features / self.seconds / 1e9


def wall_timer(method: LinearMethod, x: torch.Tensor, out: torch.Tensor) -> float:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    t = time.perf_counter()
    method.apply(x, out)
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - t


def copies_for(
    nbytes: int,
    cold_bytes: int = COLD_BYTES,
    max_copies: int = MAX_COPIES,
    held_per_copy: int = 0,
) -> int:
    """How many copies of a weight of ``nbytes`` the timing rotates through (see ``measure``):
    enough for ``cold_bytes``, at most ``max_copies`` and, when every copy's candidates hold
    ``held_per_copy`` bytes, at most what fits in ``HELD_BYTES``."""
    if nbytes < _HOT_BYTES or cold_bytes <= 0:
        return 1
    n = min(max_copies, -(-cold_bytes // nbytes))
    if held_per_copy > 0:
        n = min(n, HELD_BYTES // held_per_copy)
    return max(1, n)


def measure(
    weights: Mapping[tuple[int, int], object],
    *,
    act_dtype: torch.dtype,
    device: torch.device,
    buckets: Sequence[tuple[int, int]],
    max_rows: Mapping[tuple[int, int], int] | None = None,
    budget_s: float = 0.010,
    min_calls: int = 5,
    max_rounds: int = 200,
    passes: int = 2,
    timer: Timer = wall_timer,
    factories: Sequence[CandidateFactory] | None = None,
    skipped: dict[str, str] | None = None,
    cold_bytes: int = COLD_BYTES,
) -> list[Timing]:
    """Time every candidate for every weight shape and bucket (see the module docstring).

    ``weights``: a weight source per shape (a dense tensor or a quantized source).
    ``max_rows``: per shape, the largest M it ever runs with (the lm_head: the sampled rows);
    buckets probed above it are not measured. Each candidate runs about ``budget_s`` per
    bucket and pass (at least ``min_calls`` timed calls, after one warm-up call).

    NOTE: each call reads a different copy of the weight (``copies_for``: together about
    ``cold_bytes``, all candidates' copies of a shape within ``HELD_BYTES``), so the weight
    comes from memory as in the model, whose step streams every
    layer's weights through the caches. Timed on one weight, a candidate runs on weights hot
    in the caches, and the ranking differs: on the AMX Xeon ``torch.mm`` in bf16 won hot at
    M 9-32 but took 1.4x oneDNN's time on cold weights, which is what the step saw.
    Shapes are measured one at a time, so only one shape's copies are held at once.
    """
    timings: list[Timing] = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for shape, weight in weights.items():
        out_f, in_f = shape
        first = candidate_methods(
            weight, act_dtype=act_dtype, device=device, skipped=skipped, factories=factories
        )
        src_bytes = int(getattr(weight, "nbytes", 0))
        held = src_bytes + sum(m.nbytes for m in first if not m.shares_source)
        n_copies = copies_for(src_bytes, cold_bytes, held_per_copy=held)
        # name -> the method built on each copy (the first copy's method names the candidate)
        rotations: dict[str, list[LinearMethod]] = {m.name: [m] for m in first}
        for _ in range(n_copies - 1):
            for m in candidate_methods(
                copy.deepcopy(weight), act_dtype=act_dtype, device=device, factories=factories
            ):
                if m.name in rotations:
                    rotations[m.name].append(m)
        # NOTE: each copy's own layout is made now: ``prepare`` otherwise runs inside a
        # method's first call, so a candidate holding copies spent its timing budget making
        # them (fewer clean calls than one reading the source). A candidate whose copy
        # cannot be made keeps one, and its warm-up call below reports why.
        for ms in rotations.values():
            try:
                for m in ms:
                    m.prepare()
            except Exception:  # noqa: BLE001 - reported by the warm-up call
                del ms[1:]
        limit = (max_rows or {}).get(shape, M_MAX)
        # (max_m, rows, x, out, candidates that ran their warm-up calls)
        cells: list[tuple[int, int, torch.Tensor, torch.Tensor, list[str]]] = []
        for max_m, probe_m in buckets:
            if probe_m > limit and max_m != buckets[0][0]:
                continue
            rows = min(probe_m, limit)
            x = torch.randn(rows, in_f, generator=gen).to(device=device, dtype=act_dtype)
            out = torch.empty(rows, out_f, device=device, dtype=act_dtype)
            alive: list[str] = []
            for name, ms in rotations.items():
                if rows < ms[0].min_rows:
                    continue
                try:
                    # NOTE: one warm-up call (first-call setup: oneDNN builds a primitive per
                    # shape, shared by every copy); the copies stay cold for the timing.
                    ms[0].apply(x, out)
                    alive.append(name)
                except Exception as e:  # noqa: BLE001 - a failing candidate is skipped
                    reason = f"{type(e).__name__}: {e}"
                    log.debug("kernel candidate %s skipped for %s: %s", name, shape, reason)
                    if skipped is not None:
                        skipped[name] = reason
                    timings.append(_timing(shape, max_m, rows, ms[0], None, reason))
            cells.append((max_m, rows, x, out, alive))
        best: dict[tuple[int, str], float] = {}
        # NOTE: every cell is measured in each of ``passes`` passes and the best call of all
        # passes counts: a burst of load on a shared machine that spoils one pass of a slow
        # kernel (a few calls only) rarely spoils the next.
        turn = 0
        for _ in range(passes):
            for max_m, _rows, x, out, alive in cells:
                running = list(alive)
                spent = dict.fromkeys(alive, 0.0)
                for round_ in range(max_rounds):
                    for name in running:  # NOTE: interleaved: load bursts hit every candidate
                        ms = rotations[name]
                        dt = timer(ms[turn % len(ms)], x, out)
                        best[(max_m, name)] = min(best.get((max_m, name), float("inf")), dt)
                        spent[name] += dt
                    turn += 1
                    if round_ + 1 < min_calls:
                        continue
                    # NOTE: after its first calls, a candidate more than ``SITS_OUT`` times
                    # the fastest one's best sits out the cell's other rounds: the rounds go
                    # on until the fastest has spent its budget, and a slow candidate ran
                    # every one (the tiled dequantization, on the embedded GGUF: 13 of the
                    # 22.5 s the quantized selection took on the AMX Xeon).
                    fastest = min(best[(max_m, n)] for n in running)
                    running = [n for n in running if best[(max_m, n)] <= SITS_OUT * fastest]
                    if all(spent[n] >= budget_s for n in running):
                        break
        for max_m, rows, _x, _out, alive in cells:
            for name in alive:
                timings.append(_timing(shape, max_m, rows, rotations[name][0], best[(max_m, name)]))
        del rotations, cells
    return timings


def _timing(
    shape: tuple[int, int],
    max_m: int,
    rows: int,
    m: LinearMethod,
    seconds: float | None,
    error: str = "",
) -> Timing:
    return Timing(
        shape[0], shape[1], max_m, rows, m.name, seconds, m.nbytes, error, m.shares_source
    )
