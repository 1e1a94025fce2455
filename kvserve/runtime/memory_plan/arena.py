"""Pack buffer lifetimes into one arena: ``pack_intervals`` and the figures that judge it.

Each ``Interval`` is one buffer, live from one op to another; ``pack_intervals`` gives each an
offset so that buffers live at the same op never overlap (greedy by size, best fit), and
``ArenaPlan`` reports the arena's peak against the naive sum and the lower bound
(``live_bytes_lower_bound``: the most bytes live at one op).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ARENA_ALIGNMENT = 64  # bytes; every offset and size in a plan is a multiple of it


# ---------------------------------------------------------------------------------- packing
@dataclass(frozen=True, slots=True)
class Interval:
    """One buffer: live from op ``start`` to op ``end`` (both inclusive), ``size`` bytes."""

    start: int
    end: int
    size: int
    label: str = ""


def _align(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


def _check_intervals(intervals: Sequence[Interval], alignment: int) -> None:
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    for i, iv in enumerate(intervals):
        if iv.start < 0 or iv.end < iv.start or iv.size < 0:
            raise ValueError(
                f"interval {i} ({iv.label or 'unnamed'}) is invalid: start={iv.start}, "
                f"end={iv.end}, size={iv.size} (need 0 <= start <= end and size >= 0)"
            )


def live_bytes_lower_bound(intervals: Sequence[Interval], alignment: int = 1) -> int:
    """Most (aligned) bytes live at any one op: no arena for these lifetimes can be smaller."""
    _check_intervals(intervals, alignment)
    events: list[tuple[int, int]] = []
    for iv in intervals:
        size = _align(iv.size, alignment)
        events.append((iv.start, size))
        events.append((iv.end + 1, -size))
    # NOTE: at equal times frees sort first: an interval ending at op t and one starting at
    # op t + 1 are never live together.
    events.sort()
    live = best = 0
    for _, delta in events:
        live += delta
        best = max(best, live)
    return best


@dataclass(frozen=True)
class ArenaPlan:
    """Arena offsets for a set of lifetimes, with the figures that judge the packing."""

    intervals: tuple[Interval, ...]
    offsets: tuple[int, ...]  # offsets[i] is where intervals[i] lives in the arena
    alignment: int
    peak_bytes: int  # arena size: max(offset + aligned size)
    naive_bytes: int  # sum of aligned sizes: every tensor its own buffer
    lower_bound_bytes: int  # max aligned bytes live at one op

    def check(self) -> None:
        """Raise AssertionError naming the first broken invariant of the plan."""
        a = self.alignment
        assert len(self.offsets) == len(self.intervals), "one offset per interval"
        order = sorted(range(len(self.intervals)), key=lambda i: self.intervals[i].start)
        active: list[int] = []
        for i in order:
            iv, off = self.intervals[i], self.offsets[i]
            size = _align(iv.size, a)
            assert off % a == 0, f"interval {i}: offset {off} not aligned to {a}"
            assert off + size <= self.peak_bytes, f"interval {i} ends past the arena"
            active = [j for j in active if self.intervals[j].end >= iv.start]
            for j in active:
                other, o_off = self.intervals[j], self.offsets[j]
                o_size = _align(other.size, a)
                if size and o_size:
                    assert off + size <= o_off or o_off + o_size <= off, (
                        f"intervals {j} [{other.start}, {other.end}] @ {o_off}+{o_size} and "
                        f"{i} [{iv.start}, {iv.end}] @ {off}+{size} overlap in time and memory"
                    )
            active.append(i)
        assert self.lower_bound_bytes <= self.peak_bytes <= self.naive_bytes, (
            f"peak {self.peak_bytes} outside [lower bound {self.lower_bound_bytes}, "
            f"naive {self.naive_bytes}]"
        )


def pack_intervals(intervals: Sequence[Interval], alignment: int = ARENA_ALIGNMENT) -> ArenaPlan:
    """Place every interval at an arena offset; intervals live at the same op never overlap.

    Greedy by size: the largest buffers are placed first (ties: earlier start, then longer
    life), each at the smallest gap between the already-placed buffers that are live at the
    same time and that fits it (best fit), or on top of them when no gap fits.
    Every placement ends at most at the sum of the sizes placed so far, so the peak is
    never above the naive sum; it is never below the lower bound.
    """
    _check_intervals(intervals, alignment)
    n = len(intervals)
    sizes = [_align(iv.size, alignment) for iv in intervals]
    order = sorted(
        range(n),
        key=lambda i: (-sizes[i], intervals[i].start, -(intervals[i].end - intervals[i].start)),
    )
    starts = np.empty(n, dtype=np.int64)
    ends = np.empty(n, dtype=np.int64)
    placed_off = np.empty(n, dtype=np.int64)
    placed_size = np.empty(n, dtype=np.int64)
    offsets = [0] * n
    num_placed = 0
    for i in order:
        iv, size = intervals[i], sizes[i]
        k = num_placed
        live = (starts[:k] <= iv.end) & (ends[:k] >= iv.start)  # overlapping lifetimes
        offset = _best_fit(placed_off[:k][live], placed_size[:k][live], size)
        offsets[i] = offset
        starts[k], ends[k], placed_off[k], placed_size[k] = iv.start, iv.end, offset, size
        num_placed += 1
    peak = max((o + s for o, s in zip(offsets, sizes, strict=True)), default=0)
    return ArenaPlan(
        intervals=tuple(intervals),
        offsets=tuple(offsets),
        alignment=alignment,
        peak_bytes=peak,
        naive_bytes=sum(sizes),
        lower_bound_bytes=live_bytes_lower_bound(intervals, alignment),
    )


def _best_fit(offsets: np.ndarray, sizes: np.ndarray, size: int) -> int:
    """Lowest-waste gap of at least ``size`` bytes among the occupied ranges, else the top."""
    if size == 0 or offsets.size == 0:
        return 0
    order = np.argsort(offsets, kind="stable")
    best_offset, best_waste = -1, math.inf
    top = 0  # end of the occupied region below the current range
    for off, sz in zip(offsets[order].tolist(), sizes[order].tolist(), strict=True):
        gap = off - top
        if gap >= size and gap - size < best_waste:
            best_offset, best_waste = top, gap - size
        top = max(top, off + sz)
    return best_offset if best_offset >= 0 else top


__all__ = ["ARENA_ALIGNMENT", "ArenaPlan", "Interval", "live_bytes_lower_bound", "pack_intervals"]
