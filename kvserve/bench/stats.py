"""Percentiles and summaries shared by every benchmark (pure Python)."""

from __future__ import annotations

import math
from collections.abc import Sequence

PERCENTILES = (50.0, 90.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation, as ``numpy.percentile``.

    Raises ValueError on an empty sequence or ``q`` outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """``{"mean", "median", "p90", "p99", "max", "count"}``; NaN figures when empty.

    NOTE: NaN (not 0) for an empty sample, so a missing figure never reads as "instant".
    """
    if not values:
        nan = float("nan")
        return {"mean": nan, "median": nan, "p90": nan, "p99": nan, "max": nan, "count": 0}
    return {
        "mean": sum(values) / len(values),
        "median": percentile(values, 50.0),
        "p90": percentile(values, 90.0),
        "p99": percentile(values, 99.0),
        "max": max(values),
        "count": len(values),
    }
