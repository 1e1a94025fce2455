"""Choose: from the measured timings, the method per weight shape and M bucket (``choose``),
and the outcome every selection returns (``Selection``).

The fastest candidate per bucket is chosen; one that holds its own copy of the weight
(prepacked) must beat the one that reads the model's weight by ``margin`` to be taken. Given
the calls a decode step makes of each shape, the decode buckets' choices then go through the
step check (``check.step_check``), whose plan may replace the per-shape one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvserve.runtime.autotune.measure import Timing
from kvserve.runtime.linear import M_MAX, LinearPlan, dtype_tag


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
    # The step check's records per checked bucket (``check.StepCheck.as_dict``).
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


def plan_of(selection: Selection) -> LinearPlan | None:
    """The ``LinearPlan`` to hand the model (None: the original path)."""
    return None if selection.source == "off" else selection.plan
