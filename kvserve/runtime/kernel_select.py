"""Kernel selection by measurement: which ``LinearMethod`` runs each projection, per M bucket.

At start-up, for every distinct weight shape of the model (qkv, o, gate/up, down, lm_head)
and every M bucket (decode sizes 1, 2-8, 9-16, 17-32, 33-128, then prefill chunks of 129-256 and
above, probed at 256 and 512 rows), each candidate that the registered factories offer (see
``kvserve.runtime.linear``) runs on random data of that shape: the candidates take turns
(interleaved, so a burst of load on a shared machine hits all of them), each is timed for a
few milliseconds on weights cold in the caches (each call reads another copy, as each layer
of the model does), and its best time counts. The fastest per bucket is chosen; a candidate
that holds its own copy of the weight (prepacked) must beat the one that reads the model's
weight by ``margin`` to be taken. A candidate that raises is skipped with the reason logged.
Given the calls a decode step makes of each shape (``counts``), the decode buckets' choices
are then checked on whole steps' projections (``kvserve.runtime.plan_check``), whose plan
may replace the per-shape one.

The decision is cached (``kernel_cache``: keyed by the CPU, torch, threads, dtype, shapes,
buckets and candidate factories), so a second start-up costs nothing.

Modes: ``off`` (no measurement: ``torch.mm`` everywhere, the original path), ``auto`` (the
cache, else measure) and ``measure`` (always measure, then refresh the cache).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvserve.runtime.kernel_cache import (
    cache_key,
    cache_path,
    machine_load,
    measured_under_load,
    read_record,
    write_record,
)
from kvserve.runtime.linear import (
    M_MAX,
    CandidateFactory,
    LinearMethod,
    LinearPlan,
    candidate_methods,
    dtype_tag,
    registered_factories,
)

log = logging.getLogger(__name__)

SELECTION_MODES = ("auto", "measure", "off")
# NOTE: 9-16 apart from 17-32: probed at 32 rows only, the 9-32 bucket took AMX bf16 for
# every projection on the AMX Xeon, slower than the VNNI kernel at 12-16 rows on the gate/up
# and qkv; with the bucket, bare decode at B = 12 / 16 ran 3-14 % / 3-10 % faster
# (bench/results/session20/bucket16_ab.sh; B = 8, 24, 32 level).
DECODE_BOUNDS = (1, 8, 16, 32, 128)
PREFILL_BOUNDS = (256,)  # prefill chunks up to 256 rows, probed at 256 (then PREFILL_PROBE)
PREFILL_PROBE = 512
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
# first calls counted): neither ``choose`` nor the step check (``plan_check.TOLERANCE``)
# would take it.
SITS_OUT = 2.0

# A function that returns the seconds of one call of ``method`` on ``x`` into ``out``.
Timer = Callable[[LinearMethod, torch.Tensor, torch.Tensor], float]


def check_mode(mode: str) -> str:
    """``mode`` if it is a selection mode; else ValueError listing the choices."""
    if mode not in SELECTION_MODES:
        raise ValueError(
            f"unknown kernel selection mode {mode!r}; choose one of {', '.join(SELECTION_MODES)}"
        )
    return mode


def m_buckets() -> list[tuple[int, int]]:
    """``(max_m, probe_m)`` per bucket: the decode sizes, then two for prefill chunks.

    Each bucket is measured at its largest M (``probe_m``); the last one takes every M above
    256 and is probed at ``PREFILL_PROBE`` rows (the default ``max_num_batched_tokens``).
    NOTE: a chunk beside running decodes is often 129-256 rows, where the ranking can differ
    from 512 rows' (AMX Xeon, cold weights: oneDNN ahead at 132 rows, ``torch.mm`` at 512).
    NOTE: fixed, not derived from the engine's options: engines with other token budgets
    share one cached selection (and so run the same kernels for the same M).
    """
    bounds = (*DECODE_BOUNDS, *PREFILL_BOUNDS)
    return [*((b, b) for b in bounds), (M_MAX, PREFILL_PROBE)]


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


@dataclass
class Selection:
    """The outcome: the plan per weight shape plus what was measured (or read from cache)."""

    dtype: torch.dtype
    plan: dict[tuple[int, int], list[tuple[int, str]]]
    timings: list[Timing] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    source: str = "measured"  # "measured", "cache" or "off"
    seconds: float = 0.0
    load: float = 0.0  # machine_load() when measured
    # The step check's records per checked bucket (``plan_check.StepCheck.as_dict``).
    checks: list[dict[str, object]] = field(default_factory=list)

    def chosen(self, shape: tuple[int, int], max_m: int) -> str | None:
        """The method name chosen for ``shape`` in the bucket ending at ``max_m``."""
        for bound, name in self.plan.get(shape, []):
            if bound == max_m:
                return name
        return None

    def total_seconds(self, bounds: Iterable[int], counts: Mapping[tuple[int, int], int]) -> float:
        """Sum over shapes (x ``counts``, e.g. layers) of the chosen method's time per bucket."""
        best: dict[tuple[int, int, int], float] = {}
        for t in self.timings:
            if t.seconds is not None and t.candidate == self.chosen(
                (t.out_features, t.in_features), t.max_m
            ):
                best[(t.out_features, t.in_features, t.max_m)] = t.seconds
        total = 0.0
        for b in bounds:
            for shape, n in counts.items():
                total += n * best.get((*shape, b), 0.0)
        return total

    def summary(self) -> str:
        """One line: the dtype, where the choice came from and the method per shape/bucket."""
        if self.source == "off":
            return f"kernels: {dtype_tag(self.dtype)}, selection off (torch.mm everywhere)"
        parts = []
        for (o, i), choice in sorted(self.plan.items()):
            runs = _compress(choice)
            parts.append(f"{o}x{i}: " + ", ".join(runs))
        how = "from cache" if self.source == "cache" else f"measured in {self.seconds:.1f} s"
        return f"kernels: {dtype_tag(self.dtype)}, {how}; " + "; ".join(parts)


def _compress(choice: Sequence[tuple[int, str]]) -> list[str]:
    """``[(1, a), (8, a), (32, b), (M_MAX, b)]`` -> ``["M<=8 a", "M>8 b"]``."""
    runs: list[tuple[int, int, str]] = []  # (lo, hi, name)
    lo = 1
    for bound, name in choice:
        if runs and runs[-1][2] == name:
            runs[-1] = (runs[-1][0], bound, name)
        else:
            runs.append((lo, bound, name))
        lo = bound + 1
    if len(runs) == 1:
        return [runs[0][2]]
    out = []
    for lo, hi, name in runs:
        if hi == M_MAX:
            out.append(f"M>={lo} {name}")
        else:
            out.append(f"M<={hi} {name}" if lo == 1 else f"M {lo}-{hi} {name}")
    return out


def _wall_timer(method: LinearMethod, x: torch.Tensor, out: torch.Tensor) -> float:
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
    timer: Timer = _wall_timer,
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
                    log.warning("kernel candidate %s skipped for %s: %s", name, shape, reason)
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


def choose(
    timings: Sequence[Timing],
    buckets: Sequence[tuple[int, int]],
    *,
    margin: float = 0.05,
) -> dict[tuple[int, int], list[tuple[int, str]]]:
    """The fastest candidate per shape and bucket (deterministic: ties go to the first one
    measured). A candidate that holds its own weight copy (not ``shares_source``) must beat
    the fastest free one by ``margin`` (its memory has a price); free are the source-sharing
    candidates and the copies held anyway because another bucket of the same weight chose
    them. So a second copy (e.g. another layout of the same dense weight) is taken only
    where it beats the first by ``margin``.

    A bucket with no timing (above a shape's ``max_rows``) takes the previous bucket's choice.
    """
    by_cell: dict[tuple[int, int, int], list[Timing]] = {}
    shapes: list[tuple[int, int]] = []
    for t in timings:
        shape = (t.out_features, t.in_features)
        if shape not in shapes:
            shapes.append(shape)
        if t.seconds is not None:
            by_cell.setdefault((*shape, t.max_m), []).append(t)
    plan: dict[tuple[int, int], list[tuple[int, str]]] = {}
    for shape in shapes:
        # NOTE: a copy held for one bucket is free for the others: a second pass lets every
        # bucket take the copies the first pass kept without the margin.
        held: set[str] = set()
        for _ in range(2):
            choice: list[tuple[int, str]] = []
            # NOTE: held grows bucket by bucket too: a copy a smaller M took is free above it.
            for max_m, _ in buckets:
                cell = by_cell.get((*shape, max_m))
                if not cell:
                    if choice:
                        choice.append((max_m, choice[-1][1]))
                    continue
                free = [t for t in cell if t.shares_source or t.candidate in held]
                fastest = min(cell, key=lambda t: t.seconds)  # first of equals wins
                if free and fastest not in free:
                    base = min(free, key=lambda t: t.seconds)
                    if fastest.seconds > base.seconds * (1.0 - margin):  # type: ignore[operator]
                        fastest = base
                choice.append((max_m, fastest.candidate))
                if not fastest.shares_source:
                    held.add(fastest.candidate)
            held = {name for _, name in choice}
        if choice:
            plan[shape] = choice
    return plan


# ---- cache (records in ``kernel_cache``) ----------------------------------------------------


def load_cached(path: Path, key: Mapping[str, object], act_dtype: torch.dtype) -> Selection | None:
    """The selection cached for ``key`` at ``path`` (source "cache", ``load`` as measured),
    or None (absent; unreadable: warned)."""
    record = read_record(path, key, "kernel selection")
    if record is None:
        return None
    try:
        plan = {
            (int(o), int(i)): [(int(b), str(n)) for b, n in choice]
            for o, i, choice in record["plan"]
        }
        timings = [Timing(**t) for t in record["timings"]]
    except (ValueError, KeyError, TypeError) as e:
        log.warning("kernel selection cache %s is corrupt (%s): ignored, measuring again", path, e)
        return None
    return Selection(
        act_dtype,
        plan,
        timings,
        dict(record.get("skipped", {})),
        "cache",
        load=float(record.get("load", 0.0)),
        checks=list(record.get("checks", [])),
    )


def save_cached(path: Path, key: Mapping[str, object], sel: Selection) -> None:
    """Write ``sel`` for ``key`` (atomically: a torn write never leaves a half file)."""
    record = {
        "key": key,
        "plan": [[o, i, [list(c) for c in choice]] for (o, i), choice in sel.plan.items()],
        "timings": [asdict(t) for t in sel.timings],
        "skipped": sel.skipped,
        "load": sel.load,
        "checks": sel.checks,
    }
    write_record(path, record, "kernel selection")


# ---- entry point ---------------------------------------------------------------------------


def select_kernels(
    shapes: Iterable[tuple[int, int]],
    *,
    act_dtype: torch.dtype,
    device: torch.device | str = "cpu",
    mode: str = "auto",
    max_rows: Mapping[tuple[int, int], int] | None = None,
    timer: Timer = _wall_timer,
    factories: Sequence[CandidateFactory] | None = None,
    directory: Path | None = None,
    margin: float = 0.05,
    budget_s: float = 0.010,
    counts: Mapping[tuple[int, int], int] | None = None,
) -> Selection:
    """Choose a method per weight shape and M bucket (see the module docstring).

    ``shapes``: the (out, in) of every distinct projection weight; the candidates run on
    random weights of those shapes (timings do not depend on the values), so this can run
    before the model's weights are loaded. ``counts``: the calls a decode step makes of each
    shape, in step order (layers; the lm_head once); given, the decode buckets' choices are
    checked on whole steps (``plan_check``). Raises ValueError for an unknown ``mode``.
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
    path = cache_path(key, directory)
    load = machine_load()
    if mode == "auto":
        cached = load_cached(path, key, act_dtype)
        if cached is not None and measured_under_load(cached.load, load):
            log.info(
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
    }  # [out, in] views of [in, out] storage: the model's layout (see models/llama.py)
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
    plan = choose(timings, buckets, margin=margin)
    from kvserve.runtime.plan_check import step_check  # NOTE: it imports this module

    plan, checks = step_check(
        weights, counts, plan, timings, act_dtype, device, facs, max_rows, margin
    )
    sel = Selection(
        act_dtype, plan, timings, skipped, "measured", time.perf_counter() - t0, load, checks
    )
    save_cached(path, key, sel)
    return sel


def plan_of(selection: Selection) -> LinearPlan | None:
    """The ``LinearPlan`` to hand the model (None: the original path)."""
    return None if selection.source == "off" else selection.plan
