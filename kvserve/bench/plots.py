"""Side-by-side PNG plots of result records (matplotlib, headless).

Records are the JSON files the bench commands and the peer scripts write (see report.py):
``benchmark`` (throughput / serve / capacity / prefix), ``system``, ``mode`` and ``results``.
Optional parts drawn when present: ``latency_samples`` (serve and throughput records, and each
capacity row) for latency CDFs; ``timeline`` (throughput records, capacity rows) for memory
over time; capacity rows with ``kv_budget_tokens`` for the block-size sweep and the paged vs
contiguous comparison.
"""

from __future__ import annotations

import json
import math
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
    """The concurrency a throughput / serve record ran at.

    The batch size or request bound when the record has one; else its request count,
    capped by the engine's ``max_num_seqs`` (an offline kvserve run of more requests than
    ``max_num_seqs`` never had more in flight).
    """
    for key in ("batch_size", "max_concurrency"):
        if rec.get(key):
            return int(rec[key])
    num_requests = int(rec["results"]["num_requests"])
    max_num_seqs = (rec.get("engine") or {}).get("max_num_seqs")
    return min(num_requests, int(max_num_seqs)) if max_num_seqs else num_requests


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


def capacity_rows(records: list[Record], *, budget: bool) -> list[dict[str, Any]]:
    """Error-free capacity rows: of ``--kv-budget-tokens`` sweeps, or of ``--kv-blocks`` ones."""
    return [
        row
        for r in records
        if r["benchmark"] == "capacity"
        for row in r["results"]
        if "error" not in row and (row.get("kv_budget_tokens") is not None) is budget
    ]


def _row_label(row: dict[str, Any]) -> str:
    """``paged bs=16`` for a capacity row (allocator and block size as recorded)."""
    return f"{row.get('kv_allocator', 'paged')} bs={row.get('block_size', '?')}"


def plot_capacity(records: list[Record], path: Path) -> Path | None:
    """``--kv-blocks`` sweeps: peak running requests, preemptions and KV use vs pool size."""
    rows = capacity_rows(records, budget=False)
    if not rows:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (
        ("max_concurrent_requests", "max concurrent requests"),
        ("preemptions_per_1k_scheduled", "preemptions per 1k scheduled"),
        ("kv_utilization", "kv_utilization (mean) / kv_usage peak (dashed)"),
    )
    by_seqs: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        allocator = "" if "kv_allocator" not in row else f"{_row_label(row)}, "
        by_seqs[(allocator, int(row["max_num_seqs"]))].append(row)
    for ax, (key, title) in zip(axes, panels, strict=True):
        for i, ((allocator, seqs), rs) in enumerate(sorted(by_seqs.items())):
            rs.sort(key=lambda row: row["num_kv_blocks"])
            xs = [row["num_kv_blocks"] for row in rs]
            ax.plot(
                xs,
                [row[key] for row in rs],
                marker="o",
                color=f"C{i}",
                label=f"{allocator}max_num_seqs={seqs}",
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


def _latency_series(records: list[Record]) -> list[tuple[str, dict[str, list[float]]]]:
    """(legend, latency_samples) of every serve / throughput record and capacity row."""
    out = []
    for rec in records:
        if rec["benchmark"] in ("serve", "throughput") and rec.get("latency_samples"):
            label = f"{series_name(rec)} c={concurrency(rec)}"
            if rec.get("label"):
                label += f" {rec['label']}"
            out.append((label, rec["latency_samples"]))
        elif rec["benchmark"] == "capacity":
            for row in rec["results"]:
                if "error" not in row and row.get("latency_samples"):
                    out.append((_row_label(row), row["latency_samples"]))
    return out


def plot_latency_cdf(records: list[Record], path: Path) -> Path | None:
    """CDFs of TTFT, TPOT, ITL and e2e (ms, log x), one line per run."""
    series = _latency_series(records)
    if not series:
        return None
    metrics = ("ttft", "tpot", "itl", "e2e")
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, metric in zip(axes, metrics, strict=True):
        drawn: list[float] = []
        for i, (label, samples) in enumerate(series):
            values = sorted(v for v in samples.get(metric) or [] if v is not None and v > 0)
            if not values:
                continue
            n = len(values)
            ys = [(k + 1) / n for k in range(n)]
            ax.step([v * 1e3 for v in values], ys, where="post", color=f"C{i % 10}", label=label)
            drawn += [values[0] * 1e3, values[-1] * 1e3]
        if drawn:
            log_ms_axis(ax, min(drawn), max(drawn))
        else:  # e.g. ITL of throughput / capacity records written before they kept gaps
            ax.text(0.5, 0.5, "no samples", ha="center", transform=ax.transAxes, alpha=0.6)
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{metric.upper()} CDF")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def log_ms_axis(ax: Any, lo: float, hi: float) -> None:
    """A log x axis over [lo, hi] ms labelled with plain numbers (10, 20, 50, 100, ...) that
    do not overlap: 1-2-5 steps over at most two decades, decades (every k-th one over many)
    beyond; minor ticks unlabelled.

    NOTE: matplotlib's default labels the minor ticks (``2x10^3``, ``3x10^3``...) when the data
    span under a decade or so, which ran the labels into each other on a 5-inch panel.
    """
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    decades = math.log10(max(hi, lo * 1.0001)) - math.log10(lo)
    subs = (1.0, 2.0, 5.0) if decades <= 2 else (1.0,)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs, numticks=7))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _timeline_series(records: list[Record]) -> list[tuple[str, dict[str, list[float]]]]:
    """(legend, timeline) of every throughput record and capacity row that kept one."""
    out = []
    for rec in records:
        if rec["benchmark"] == "throughput" and rec.get("timeline"):
            label = series_name(rec) + (f" {rec['label']}" if rec.get("label") else "")
            out.append((label, rec["timeline"]))
        elif rec["benchmark"] == "capacity":
            for row in rec["results"]:
                if "error" not in row and row.get("timeline"):
                    out.append((_row_label(row), row["timeline"]))
    return out


def plot_memory_timeline(records: list[Record], path: Path) -> Path | None:
    """KV use over time: kv_usage (solid) and kv_utilization (dashed), running requests."""
    series = [(label, tl) for label, tl in _timeline_series(records) if tl.get("t_s")]
    if not series:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    for i, (label, tl) in enumerate(series):
        color = f"C{i % 10}"
        ts = tl["t_s"]
        axes[0].plot(ts, tl["kv_usage"], color=color, label=label)
        axes[0].plot(ts, tl["kv_utilization"], "--", color=color, alpha=0.7)
        axes[1].plot(ts, tl["num_running"], color=color, label=label)
    axes[0].set_title("kv_usage (solid) and kv_utilization (dashed) per step")
    axes[0].set_ylim(0, 1.02)
    axes[1].set_title("running requests per step")
    for ax in axes:
        ax.set_xlabel("seconds since the run began")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def plot_block_size_sweep(records: list[Record], path: Path) -> Path | None:
    """Block-size sweep at a fixed KV budget: kv_utilization against throughput per size."""
    by_alloc: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for row in capacity_rows(records, budget=True):
        # NOTE: rows of several records merge (e.g. one allocator run per file) when they
        # share the budget and max_num_seqs; the last record read wins a duplicate point.
        alloc = row.get("kv_allocator", "paged")
        name = f"{alloc}, {row['kv_budget_tokens']} tokens, max_seqs={row['max_num_seqs']}"
        by_alloc[name][int(row["block_size"])] = row
    by_alloc = {a: rows for a, rows in by_alloc.items() if len(rows) >= 2}
    if not by_alloc:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    twin = axes[1].twinx()
    for i, (alloc, rows) in enumerate(sorted(by_alloc.items())):
        sizes = sorted(rows)
        utils = [rows[b]["kv_utilization"] for b in sizes]
        tputs = [rows[b]["output_tokens_per_s"] for b in sizes]
        axes[0].plot(utils, tputs, marker="o", color=f"C{i}", label=alloc)
        for b, x, y in zip(sizes, utils, tputs, strict=True):
            axes[0].annotate(
                f"bs={b}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8
            )
        axes[1].plot(sizes, utils, marker="o", color=f"C{i}", label=f"{alloc} kv_utilization")
        conc = [rows[b]["max_concurrent_requests"] for b in sizes]
        twin.plot(sizes, conc, "--", marker="s", color=f"C{i}", label=f"{alloc} max concurrent")
    axes[0].set_xlabel("kv_utilization (mean over busy steps)")
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title("utilization vs throughput, one point per block size")
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[1].set_xscale("log", base=2)
    all_sizes = sorted({b for rows in by_alloc.values() for b in rows})
    axes[1].set_xticks(all_sizes, [str(b) for b in all_sizes])
    axes[1].minorticks_off()
    axes[1].set_xlabel("block size (tokens)")
    axes[1].set_ylabel("kv_utilization (solid)")
    twin.set_ylabel("max concurrent requests (dashed)")
    axes[1].set_title("per block size, same KV budget")
    axes[1].grid(alpha=0.3)
    axes[1].legend(fontsize=8, loc="lower left")
    return _save(fig, path)


def plot_allocators(records: list[Record], path: Path) -> Path | None:
    """Paged vs contiguous at the same KV budget: concurrency (with ratio), utilization, tok/s."""
    pairs: dict[tuple, dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in capacity_rows(records, budget=True):
        key = (row["kv_budget_tokens"], int(row["block_size"]), int(row["max_num_seqs"]))
        pairs[key][row.get("kv_allocator", "paged")] = row
    keys = sorted(k for k, p in pairs.items() if {"paged", "contiguous"} <= p.keys())
    if not keys:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    names = [f"{budget} tokens\nbs={bs}\nmax_seqs={seqs}" for budget, bs, seqs in keys]
    panels = (
        ("max_concurrent_requests", "max concurrent requests (paged / contiguous ratio)"),
        ("kv_utilization", "kv_utilization (tokens stored / allocated)"),
        ("output_tokens_per_s", "output tokens/s"),
    )
    width = 0.38
    for ax, (key, title) in zip(axes, panels, strict=True):
        for j, alloc in enumerate(("paged", "contiguous")):
            xs = [i + (j - 0.5) * width for i in range(len(keys))]
            ax.bar(xs, [pairs[k][alloc][key] for k in keys], width, label=alloc)
        if key == "max_concurrent_requests":
            for i, k in enumerate(keys):
                p, c = (pairs[k][a][key] for a in ("paged", "contiguous"))
                top = max(p, c)
                text = f"{p / c:.2f}x" if c else "-"
                ax.annotate(
                    text,
                    (i, top),
                    textcoords="offset points",
                    xytext=(0, 4),
                    ha="center",
                    fontsize=9,
                )
        ax.set_xticks(range(len(keys)), names, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def _rate(rec: Record) -> float | None:
    """The finite request rate of a serve record (None for all-at-once or unset)."""
    rate = rec.get("request_rate")
    return float(rate) if isinstance(rate, (int, float)) and rate != float("inf") else None


def plot_goodput(records: list[Record], path: Path) -> Path | None:
    """Serve records swept over request rates: SLO attainment, ITL p99 / median, TTFT p90.

    One line per ``label`` (else system and mode); needs two rates or more for some line.
    """
    lines: dict[str, list[tuple[float, dict[str, Any]]]] = defaultdict(list)
    for rec in records:
        rate = _rate(rec)
        if rec["benchmark"] == "serve" and rate is not None:
            lines[rec.get("label") or series_name(rec)].append((rate, rec["results"]))
    lines = {k: sorted(v, key=lambda p: p[0]) for k, v in lines.items() if len(v) >= 2}
    if not lines:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    panels = (
        (lambda r: r["slo_attainment"], "fraction of requests meeting the SLOs"),
        (lambda r: r["itl"]["p99"] / r["itl"]["median"], "ITL p99 / median"),
        (lambda r: r["ttft"]["p90"] * 1e3, "TTFT p90 (ms)"),
    )
    for ax, (get, title) in zip(axes, panels, strict=True):
        for i, (name, points) in enumerate(sorted(lines.items())):
            pts = []
            for rate, res in points:
                try:
                    pts.append((rate, float(get(res))))
                except (KeyError, TypeError, ZeroDivisionError):
                    continue
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", color=f"C{i % 10}", label=name)
        ax.set_xlabel("request rate (requests/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].axhline(0.9, color="grey", linestyle=":", linewidth=1)
    axes[1].axhline(2.0, color="grey", linestyle=":", linewidth=1)
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def plot_all(records: list[Record], out_dir: str) -> list[str]:
    """Every plot the records allow; returns the PNG paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    made = [
        plot_throughput(records, out / "throughput_vs_concurrency.png"),
        plot_latency(records, out / "latency_percentiles.png"),
        plot_latency_cdf(records, out / "latency_cdf.png"),
        plot_memory_timeline(records, out / "memory_timeline.png"),
        plot_capacity(records, out / "capacity.png"),
        plot_block_size_sweep(records, out / "block_size_sweep.png"),
        plot_allocators(records, out / "paged_vs_contiguous.png"),
        plot_prefix(records, out / "prefix_cache.png"),
        plot_goodput(records, out / "goodput_vs_rate.png"),
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
