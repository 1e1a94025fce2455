"""Side-by-side PNG plots of result records (matplotlib, headless).

Records are the JSON files the bench commands and the peer scripts write (see report.py):
``benchmark`` (throughput / serve / capacity / prefix), ``system``, ``mode`` and ``results``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # NOTE: no display on servers; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402

Record = dict[str, Any]


def load_records(paths: list[str]) -> list[Record]:
    """Read result JSON files; folders are searched (recursively) for ``*.json``."""
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(p.rglob("*.json")) if p.is_dir() else [p])
    records = []
    for f in files:
        rec = json.loads(f.read_text(encoding="utf-8"))
        if isinstance(rec, dict) and "benchmark" in rec and "results" in rec:
            records.append(rec)
    return records


def concurrency(rec: Record) -> int:
    """The concurrency a throughput / serve record ran at (batch size or request bound)."""
    for key in ("batch_size", "max_concurrency"):
        if rec.get(key):
            return int(rec[key])
    return int(rec["results"]["num_requests"])


def series_name(rec: Record) -> str:
    """Legend entry: system and mode, e.g. ``vllm (server)``."""
    return f"{rec['system']} ({rec.get('mode', '?')})"


def _series(records: list[Record], key: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for rec in records:
        value = rec["results"].get(key)
        if value is not None:
            out[series_name(rec)].append((concurrency(rec), float(value)))
    return {name: sorted(points) for name, points in sorted(out.items())}


def plot_throughput(records: list[Record], path: Path) -> Path | None:
    """Output tokens/s (and requests/s) vs concurrency, one line per system and mode."""
    recs = [r for r in records if r["benchmark"] in ("throughput", "serve")]
    if not recs:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in (
        (axes[0], "output_tokens_per_s", "generated tokens/s"),
        (axes[1], "requests_per_s", "requests/s"),
    ):
        for name, points in _series(recs, key).items():
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", label=name)
            for x, y in points:
                ax.annotate(
                    f"{y:.1f}",
                    (x, y),
                    textcoords="offset points",
                    xytext=(0, 5),
                    ha="center",
                    fontsize=7,
                )
        _concurrency_axis(ax, recs)
        ax.set_xlabel("concurrency (batch size / max in-flight requests)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def plot_latency(records: list[Record], path: Path) -> Path | None:
    """TTFT and TPOT median / p90 / p99 vs concurrency for the serve records."""
    recs = [r for r in records if r["benchmark"] == "serve"]
    if not recs:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"median": "-", "p90": "--", "p99": ":"}
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        by_system: dict[str, list[Record]] = defaultdict(list)
        for r in recs:
            by_system[series_name(r)].append(r)
        for i, (name, rs) in enumerate(sorted(by_system.items())):
            rs.sort(key=concurrency)
            for stat, style in styles.items():
                pts = [
                    (concurrency(r), r["results"][metric][stat])
                    for r in rs
                    if r["results"].get(metric, {}).get(stat) is not None
                ]
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(
                        xs,
                        [y * 1e3 for y in ys],
                        style,
                        marker="o",
                        color=f"C{i}",
                        label=f"{name} {stat}",
                    )
        _concurrency_axis(ax, recs)
        ax.set_yscale("log")
        ax.set_xlabel("max concurrency")
        ax.set_ylabel("ms")
        ax.set_title(f"{metric.upper()} (median solid, p90 dashed, p99 dotted)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def plot_capacity(records: list[Record], path: Path) -> Path | None:
    """Capacity sweeps: peak running requests, preemptions and KV use vs pool size."""
    rows = [
        row
        for r in records
        if r["benchmark"] == "capacity"
        for row in r["results"]
        if "error" not in row
    ]
    if not rows:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (
        ("max_concurrent_requests", "max concurrent requests"),
        ("preemptions_per_1k_scheduled", "preemptions per 1k scheduled"),
        ("kv_utilization", "kv_utilization (mean) / kv_usage peak (dashed)"),
    )
    by_seqs: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_seqs[int(row["max_num_seqs"])].append(row)
    for ax, (key, title) in zip(axes, panels, strict=True):
        for i, (seqs, rs) in enumerate(sorted(by_seqs.items())):
            rs.sort(key=lambda row: row["num_kv_blocks"])
            xs = [row["num_kv_blocks"] for row in rs]
            ax.plot(
                xs,
                [row[key] for row in rs],
                marker="o",
                color=f"C{i}",
                label=f"max_num_seqs={seqs}",
            )
            if key == "kv_utilization":
                ax.plot(xs, [row["kv_usage_peak"] for row in rs], "--", color=f"C{i}")
        ax.set_xlabel("KV pool (blocks)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def plot_prefix(records: list[Record], path: Path) -> Path | None:
    """Prefix cache on vs off: hit rate, mean TTFT and throughput per workload."""
    rows = [row for r in records if r["benchmark"] == "prefix" for row in r["results"]]
    if not rows:
        return None
    workloads = sorted({row["workload"] for row in rows})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (
        (lambda row: row["prefix_hit_rate"], "prefix_hit_rate"),
        (lambda row: row["ttft"]["mean"] * 1e3, "mean TTFT (ms)"),
        (lambda row: row["total_tokens_per_s"], "total tokens/s"),
    )
    width = 0.38
    for ax, (get, title) in zip(axes, panels, strict=True):
        for j, enabled in enumerate((True, False)):
            vals = []
            for w in workloads:
                match = [
                    r for r in rows if r["workload"] == w and r["enable_prefix_caching"] is enabled
                ]
                vals.append(get(match[-1]) if match else 0.0)
            xs = [i + (j - 0.5) * width for i in range(len(workloads))]
            ax.bar(xs, vals, width, label=f"prefix cache {'on' if enabled else 'off'}")
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def plot_all(records: list[Record], out_dir: str) -> list[str]:
    """Every plot the records allow; returns the PNG paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    made = [
        plot_throughput(records, out / "throughput_vs_concurrency.png"),
        plot_latency(records, out / "latency_percentiles.png"),
        plot_capacity(records, out / "capacity.png"),
        plot_prefix(records, out / "prefix_cache.png"),
    ]
    return [str(p) for p in made if p is not None]


def _concurrency_axis(ax: Any, recs: list[Record]) -> None:
    """Log2 x axis with a plain tick at every concurrency that was run."""
    ticks = sorted({concurrency(r) for r in recs})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
