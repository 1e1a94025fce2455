"""Percentiles and summaries shared by every benchmark (pure Python)."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.percentile import percentile

__all__ = ["PERCENTILES", "percentile", "summarize"]

PERCENTILES = (50.0, 90.0, 99.0)


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
