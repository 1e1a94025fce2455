"""Result records (JSON) and the plain-text tables the bench commands print."""

from __future__ import annotations

import json
import math
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

LATENCIES = ("ttft", "tpot", "itl", "e2e", "queue_time")
# NOTE: per-step timelines and latency samples stay plottable but small in the JSON records.
MAX_TIMELINE_POINTS = 500
MAX_CDF_POINTS = 1000


def kvserve_version() -> str:
    """The installed kvserve version (``unknown`` outside an install)."""
    try:
        return metadata.version("kvserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def make_record(benchmark: str, results: Any, **meta: Any) -> dict[str, Any]:
    """One result record: what ran (benchmark, system, version, settings) and its figures."""
    record: dict[str, Any] = {
        "benchmark": benchmark,
        "system": meta.pop("system", "kvserve"),
        "version": meta.pop("version", kvserve_version()),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    record.update(meta)
    record["results"] = results
    return record


def cdf_points(values: list[float], max_points: int = MAX_CDF_POINTS) -> list[float]:
    """``values`` sorted, thinned to at most ``max_points`` evenly spaced order statistics.

    The smallest and largest values are always kept, so the CDF drawn from the points spans
    the whole sample. Raises ValueError if ``max_points < 2``.
    """
    if max_points < 2:
        raise ValueError(f"max_points must be >= 2, got {max_points}")
    s = sorted(values)
    if len(s) <= max_points:
        return s
    last = len(s) - 1
    return [s[round(i * last / (max_points - 1))] for i in range(max_points)]


def downsample_columns(
    columns: dict[str, list[Any]], max_points: int = MAX_TIMELINE_POINTS
) -> dict[str, list[Any]]:
    """Every column of a per-step timeline at the same <= ``max_points`` evenly spaced steps.

    Picks samples (it does not average them), first and last step included. Raises
    ValueError on columns of different lengths or ``max_points < 2``.
    """
    if max_points < 2:
        raise ValueError(f"max_points must be >= 2, got {max_points}")
    lengths = {len(v) for v in columns.values()}
    if len(lengths) > 1:
        raise ValueError(f"timeline columns differ in length: {sorted(lengths)}")
    n = lengths.pop() if lengths else 0
    if n <= max_points:
        return {k: list(v) for k, v in columns.items()}
    picks = [round(i * (n - 1) / (max_points - 1)) for i in range(max_points)]
    return {k: [v[i] for i in picks] for k, v in columns.items()}


def write_json(path: str | None, record: dict[str, Any]) -> None:
    """Write ``record`` to ``path`` (parents created); no-op when path is None."""
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_clean(record), indent=2, default=str, allow_nan=False)
    p.write_text(text + "\n", encoding="utf-8")


def _clean(o: Any) -> Any:
    """Strict JSON: NaN becomes None, +-inf the strings "inf" / "-inf"; containers recursively."""
    if isinstance(o, float) and math.isnan(o):
        return None
    if isinstance(o, float) and math.isinf(o):
        return "inf" if o > 0 else "-inf"
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def format_figures(fig: dict[str, Any], title: str) -> str:
    """Scalars one per line, then latency summaries in milliseconds."""
    lines = [f"==== {title} ===="]
    for key, value in fig.items():
        if isinstance(value, (dict, list)) or key in LATENCIES:
            continue
        if isinstance(value, float):
            lines.append(f"{key:<32} {value:,.4g}")
        elif value is not None:
            lines.append(f"{key:<32} {value}")
    for key in LATENCIES:
        s = fig.get(key)
        if not isinstance(s, dict) or not s.get("count"):
            continue
        lines.append(
            f"{key + ' (ms)':<32} mean {s['mean'] * 1e3:,.1f}  median {s['median'] * 1e3:,.1f}"
            f"  p90 {s['p90'] * 1e3:,.1f}  p99 {s['p99'] * 1e3:,.1f}  (n={s['count']})"
        )
    return "\n".join(lines)


def print_figures(fig: dict[str, Any], title: str) -> None:
    """Print :func:`format_figures` to stdout."""
    print(format_figures(fig, title), file=sys.stdout, flush=True)
