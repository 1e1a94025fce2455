"""Check: per decode bucket, the per-shape choice against its near alternatives, each
timed as a decode step runs it (every layer's projections in step order, on the model's bytes).

``measure.measure`` times one shape at a time, every candidate on copies that together
hold up to ``HELD_BYTES``, interleaved call by call, so the weights come from memory. A
decode step of a small model reads fewer bytes than that, which a large last-level cache
keeps partly warm, and the ranking can flip. NOTE: measured on the AMX Xeon (300 MB L3),
embedded GGUF in bf16, a layer's four projections at 32 rows: a start-up's selection timed
``q4_1_x16_amx_bf16`` (the Q4_1 blocks, 0.6 bytes a weight) at 223 us against ``int8_amx``'s
250 (an int8 copy, 1.06 bytes a weight) and took the blocks; with only those two candidates'
copies in rotation the int8 copy won, 175 against 232 us; whole decode steps alternated ran
12.2-12.7 ms on the blocks against 11.0-11.3 on the int8 copies (2026-12-06, ce25f16; at
25ace60: ``bench/probes/two_candidates.py``, ``bench/results/session30/two_candidates.txt``
and ``plan_ab.txt``).

So, for each decode bucket where a shape has a candidate within ``tolerance`` of its fastest,
the plans compared are the chosen one and, per such candidate, the plan in which every shape
that has it near takes it. Each plan runs as a pass over the model's projections: a shape
runs as many times as the step runs it (``counts``: the layers; the lm_head once), each call
on another copy of the weight, so the bytes a pass reads are the step's (past
``STREAM_BYTES`` of copies the alternatives holding the most are not tried; see
``_layer_methods``). Plans take turns pass by pass and the best pass counts; a plan that holds
more copy bytes than another, or reads more weight bytes a step, must beat it by ``margin``,
the per-shape plan too (a copy that another bucket of the same weight holds counts as free to
hold, as in ``choose.choose``: the buckets are decided twice over, so one a later
bucket took is free for an earlier one).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvserve.runtime.autotune.candidates import CandidateFactory, candidate_methods, m_buckets
from kvserve.runtime.autotune.measure import Timing
from kvserve.runtime.linear import LinearMethod

log = logging.getLogger(__name__)

# The weight bytes a check may hold, every plan's copies together (see the module docstring).
STREAM_BYTES = 768 << 20
# The buckets checked: decode sizes, where the weights' bytes decide the step.
CHECK_BOUNDS = (1, 8, 16, 32)
# NOTE: how far behind per shape a candidate may be and still be tried on steps: 50 %, since
# the per-shape ratio of the two plans in the module docstring moved from 223 / 250 (blocks
# ahead) to 232 / 175 (int8 ahead) with the copies held beside them.
TOLERANCE = 0.5

Shape = tuple[int, int]
Plan = dict[Shape, list[tuple[int, str]]]
# One pass: the (method, x, out) calls in step order -> seconds.
PassTimer = Callable[[Sequence[tuple[LinearMethod, torch.Tensor, torch.Tensor]]], float]


def _wall_pass(calls: Sequence[tuple[LinearMethod, torch.Tensor, torch.Tensor]]) -> float:
    cuda = calls[0][1].device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(calls[0][1].device)
    t = time.perf_counter()
    for method, x, out in calls:
        method.apply(x, out)
    if cuda:
        torch.cuda.synchronize(calls[0][1].device)
    return time.perf_counter() - t


@dataclass(frozen=True)
class StepCheck:
    """One bucket's check: each plan tried (shape -> method) and its best pass in seconds."""

    max_m: int
    rows: int
    plans: tuple[tuple[tuple[tuple[int, int, str], ...], float], ...]
    chosen: int  # index into ``plans``; 0 is the per-shape choice

    def as_dict(self) -> dict[str, object]:
        return {
            "max_m": self.max_m,
            "rows": self.rows,
            "plans": [[[list(p) for p in plan], s] for plan, s in self.plans],
            "chosen": self.chosen,
        }


def alternatives(
    seconds: Mapping[Shape, Mapping[str, float]], base: Mapping[Shape, str], tolerance: float
) -> list[dict[Shape, str]]:
    """The plans to try for one bucket: ``base`` first, then, per candidate within
    ``tolerance`` of some shape's fastest (``seconds``: shape -> candidate -> best call), the
    plan in which every shape that has it that near takes it (the others keep ``base``)."""
    near: dict[Shape, set[str]] = {}
    names: list[str] = []
    for shape, times in seconds.items():
        fastest = min(times.values())
        near[shape] = {n for n, s in times.items() if s <= fastest * (1.0 + tolerance)}
        names += [n for n in sorted(times, key=times.__getitem__) if n in near[shape]]
    plans = [dict(base)]
    for name in dict.fromkeys(names):
        plan = {s: name if name in near.get(s, ()) else b for s, b in base.items()}
        if plan not in plans:
            plans.append(plan)
    return plans


def check_plan(
    sources: Mapping[Shape, object],
    counts: Mapping[Shape, int],
    plan: Plan,
    timings: Sequence[Timing],
    *,
    act_dtype: torch.dtype,
    device: torch.device,
    factories: Sequence[CandidateFactory],
    max_rows: Mapping[Shape, int] | None = None,
    bounds: Sequence[int] = CHECK_BOUNDS,
    tolerance: float = TOLERANCE,
    margin: float = 0.05,
    budget_s: float = 0.030,
    min_rounds: int = 3,
    max_rounds: int = 50,
    passes: int = 2,
    timer: PassTimer | None = None,
    stream_bytes: int = STREAM_BYTES,
) -> tuple[Plan, list[StepCheck]]:
    """``plan`` with each checked bucket's choice replaced by the plan whose step pass ran
    fastest (see the module docstring), and the checks made.

    ``sources``: a weight source per shape (as ``measure`` times); ``counts``: how many calls
    of each shape a step makes, in step order; ``timings``: ``measure``'s (``Timing``). A
    bucket with one plan to try, or one whose passes fail, keeps its choice.
    """
    rows_cap = max_rows or {}
    by_cell: dict[tuple[int, Shape], dict[str, float]] = {}
    for t in timings:
        if t.seconds is not None and t.max_m in bounds:
            shape = (t.out_features, t.in_features)
            by_cell.setdefault((t.max_m, shape), {})[t.candidate] = t.seconds
    probe = dict(m_buckets())
    shapes = [s for s in counts if s in sources and s in plan]
    tried: dict[int, list[dict[Shape, str]]] = {}
    for bound in bounds:
        base = {s: name for s in shapes for b, name in plan[s] if b == bound}
        cells = {s: by_cell[(bound, s)] for s in base if (bound, s) in by_cell}
        plans = alternatives(cells, base, tolerance)
        if len(plans) > 1 and bound in probe:
            tried[bound] = plans
    if not tried:
        return plan, []
    try:
        tried, methods = _layer_methods(
            sources, counts, tried, act_dtype, device, factories, stream_bytes
        )
    except Exception as e:  # noqa: BLE001 - a check that cannot build keeps the choice
        log.warning("kernel step check skipped: %s: %s", type(e).__name__, e)
        return plan, []
    timed: dict[int, list[float]] = {}
    for bound, plans in tried.items():
        best = _time_plans(
            plans, methods, counts, probe[bound], rows_cap, act_dtype, device,
            timer or _wall_pass, budget_s, min_rounds, max_rounds, passes,
        )  # fmt: skip
        if best is not None:
            timed[bound] = best

    def held(bound: int, k: int, chosen: Plan) -> int:
        """Copy bytes plan ``k`` of ``bound`` holds that no other bucket of ``chosen`` does."""
        return sum(
            counts[s] * methods[(s, n)][0].nbytes
            for s, n in tried[bound][k].items()
            if not methods[(s, n)][0].shares_source
            and all(name != n for b, name in chosen[s] if b != bound)
        )

    def read(bound: int, k: int) -> int:
        """Weight bytes a step of plan ``k`` of ``bound`` reads (copies, or the source)."""
        total = 0
        for s, n in tried[bound][k].items():
            m = methods[(s, n)][0]
            per_call = int(getattr(sources[s], "nbytes", 0)) if m.shares_source else m.nbytes
            total += counts[s] * per_call
        return total

    new = {s: list(c) for s, c in plan.items()}
    pick: dict[int, int] = {}
    # NOTE: twice over the buckets, as ``choose.choose`` does: a copy a later bucket
    # took is free for an earlier one on the second pass.
    for _ in range(2):
        for bound, best in timed.items():
            # NOTE: from the plan holding the fewest copy bytes up: each must beat the one
            # taken so far by ``margin`` to hold more (the per-shape plan included), or to
            # read more: a pass has no K/V traffic beside its weights, and a plan reading
            # more bytes ran ahead on passes while behind on whole steps (the dense copies
            # in tiles for three shapes against the int8 copies, 2-12 % ahead on passes,
            # 3-7 % behind on B=32 steps; 2026-12-06, a7aa0fa: git show
            # 25ace60:bench/results/session30/plan_ab_final.txt).
            cost = [(held(bound, k, new), read(bound, k)) for k in range(len(best))]
            by_bytes = sorted(range(len(best)), key=cost.__getitem__)
            k_best = by_bytes[0]
            for k in by_bytes[1:]:
                more = any(a > b for a, b in zip(cost[k], cost[k_best], strict=True))
                if best[k] < best[k_best] * (1.0 - margin if more else 1.0):
                    k_best = k
            pick[bound] = k_best
            for s, name in tried[bound][k_best].items():
                new[s] = [(b, name if b == bound else n) for b, n in new[s]]
    checks = [
        StepCheck(
            bound,
            probe[bound],
            tuple(
                (tuple((o, i, n) for (o, i), n in p.items()), sec)
                for p, sec in zip(tried[bound], best, strict=True)
            ),
            pick[bound],
        )
        for bound, best in timed.items()
    ]
    return new, checks


def _layer_methods(
    sources: Mapping[Shape, object],
    counts: Mapping[Shape, int],
    tried: Mapping[int, list[dict[Shape, str]]],
    act_dtype: torch.dtype,
    device: torch.device,
    factories: Sequence[CandidateFactory],
    stream_bytes: int,
) -> tuple[dict[int, list[dict[Shape, str]]], dict[tuple[Shape, str], list[LinearMethod]]]:
    """The plans still tried per bucket and, per (shape, candidate) they use, the methods on
    ``counts[shape]`` copies of the source, their copies made.

    NOTE: every plan's copies are held at once (plans run in turn). Past ``stream_bytes`` the
    candidate that only alternatives use and that holds the most bytes is dropped (with the
    plans using it) until they fit: each plan kept reads as many bytes as in the step. Only
    when the per-shape plans alone pass it do the calls rotate through fewer copies (a step
    that large is more than a last-level cache holds anyway).
    """
    shapes = list(next(iter(tried.values()))[0])
    offered: dict[Shape, dict[str, LinearMethod]] = {}
    for s in shapes:
        ms = candidate_methods(sources[s], act_dtype=act_dtype, device=device, factories=factories)
        offered[s] = {m.name: m for m in ms}
    base = {s: {plans[0][s] for plans in tried.values()} for s in shapes}

    def held(s: Shape, name: str) -> int:  # bytes of one copy beyond the source
        m = offered[s][name]
        return 0 if m.shares_source else m.nbytes

    def wanted() -> dict[Shape, set[str]]:
        return {s: {p[s] for plans in tried.values() for p in plans} for s in shapes}

    def total() -> int:
        return sum(
            counts[s] * (int(getattr(sources[s], "nbytes", 0)) + sum(held(s, n) for n in names))
            for s, names in wanted().items()
        )

    tried = {b: list(plans) for b, plans in tried.items()}
    for s, names in wanted().items():
        missing = names - set(offered[s])
        if missing:
            raise ValueError(f"candidates {sorted(missing)} not offered for {s}")
    while total() > stream_bytes:
        now = wanted()
        extra = {
            n: sum(counts[s] * held(s, n) for s in shapes if n in now[s] and n not in base[s])
            for n in sorted(set().union(*now.values()))
        }
        extra = {n: b for n, b in extra.items() if b > 0}
        if not extra:
            break
        drop = max(extra, key=extra.__getitem__)
        log.debug("kernel step check: %s not tried (its copies pass %d bytes)", drop, stream_bytes)
        for b, plans in list(tried.items()):
            kept = [p for k, p in enumerate(plans) if k == 0 or drop not in p.values()]
            if len(kept) > 1:
                tried[b] = kept
            else:
                del tried[b]
        if not tried:
            return {}, {}
    scale = min(1.0, stream_bytes / total())
    need = wanted()
    out: dict[tuple[Shape, str], list[LinearMethod]] = {}
    for s in shapes:
        for name in need[s]:
            offered[s][name].prepare()
            out[(s, name)] = [offered[s][name]]
        for _ in range(max(1, round(counts[s] * scale)) - 1):
            ms = candidate_methods(
                copy.deepcopy(sources[s]), act_dtype=act_dtype, device=device, factories=factories
            )
            for m in ms:
                if m.name in need[s]:
                    m.prepare()
                    out[(s, m.name)].append(m)
    return tried, out


def _time_plans(
    plans: Sequence[Mapping[Shape, str]],
    methods: Mapping[tuple[Shape, str], list[LinearMethod]],
    counts: Mapping[Shape, int],
    rows: int,
    rows_cap: Mapping[Shape, int],
    act_dtype: torch.dtype,
    device: torch.device,
    timer: PassTimer,
    budget_s: float,
    min_rounds: int,
    max_rounds: int,
    passes: int,
) -> list[float] | None:
    """Each plan's best pass in seconds at ``rows`` rows, or None when a pass fails."""
    gen = torch.Generator(device="cpu").manual_seed(3)
    io: dict[Shape, tuple[torch.Tensor, torch.Tensor]] = {}
    for s in plans[0]:
        m = min(rows, rows_cap.get(s, rows))
        x = torch.randn(m, s[1], generator=gen).to(device=device, dtype=act_dtype)
        io[s] = (x, torch.empty(m, s[0], device=device, dtype=act_dtype))
    order: list[tuple[Shape, int]] = []  # the step's calls: layer by layer, shapes in order
    for i in range(max(counts[s] for s in plans[0])):
        order += [(s, i) for s in counts if s in plans[0] and i < counts[s]]
    runs = []
    for plan in plans:
        calls = []
        for s, i in order:
            ms = methods[(s, plan[s])]
            calls.append((ms[i % len(ms)], *io[s]))
        runs.append(calls)
    best = [float("inf")] * len(runs)
    try:
        for calls in runs:  # NOTE: one warm-up pass each (first-call set-up)
            timer(calls)
        for _ in range(passes):
            spent = [0.0] * len(runs)
            for round_ in range(max_rounds):
                for k, calls in enumerate(runs):  # NOTE: interleaved: load hits every plan
                    dt = timer(calls)
                    best[k] = min(best[k], dt)
                    spent[k] += dt
                if round_ + 1 >= min_rounds and min(spent) >= budget_s:
                    break
    except Exception as e:  # noqa: BLE001 - a failing pass keeps the per-shape choice
        log.warning("kernel step check at %d rows skipped: %s: %s", rows, type(e).__name__, e)
        return None
    return best


def step_check(
    weights: Mapping[Shape, object],
    counts: Mapping[Shape, int] | None,
    plan: Plan,
    timings: Sequence[Timing],
    act_dtype: torch.dtype,
    device: torch.device,
    factories: Sequence[CandidateFactory],
    max_rows: Mapping[Shape, int] | None,
    margin: float,
) -> tuple[Plan, list[dict[str, object]]]:
    """What the selections call: ``plan`` after ``check_plan`` on ``counts`` (unchanged
    without counts), with the checks' records; each bucket whose choice changed is logged."""
    if not counts:
        return plan, []
    new, checks = check_plan(
        weights,
        counts,
        plan,
        timings,
        act_dtype=act_dtype,
        device=device,
        factories=factories,
        max_rows=max_rows,
        margin=margin,
    )
    for c in checks:
        if c.chosen:
            plans = c.plans
            log.debug(
                "kernel step check at %d rows: %s (%.2f ms a step) over the per-shape choice "
                "(%.2f ms)",
                c.rows,
                ", ".join(f"{o}x{i} {n}" for o, i, n in plans[c.chosen][0]),
                plans[c.chosen][1] * 1e3,
                plans[0][1] * 1e3,
            )
    return new, [c.as_dict() for c in checks]
