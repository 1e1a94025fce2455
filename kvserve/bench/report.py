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
        if isinstance(value, dict) or key in LATENCIES:
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
