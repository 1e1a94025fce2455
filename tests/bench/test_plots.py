import json

from kvserve.bench.plots import concurrency, load_records, plot_all
from kvserve.bench.report import make_record, write_json


def _lat(v: float) -> dict:
    return {"mean": v, "median": v, "p90": 2 * v, "p99": 3 * v, "max": 3 * v, "count": 4}


def test_plot_all_writes_every_figure_from_records(tmp_path) -> None:
    res = tmp_path / "res"
    for b in (1, 8):
        tp = {"num_requests": b, "output_tokens_per_s": 10.0 * b, "requests_per_s": 0.1 * b}
        write_json(str(res / f"off_{b}.json"), make_record("throughput", tp, mode="offline"))
        sv = {**tp, "ttft": _lat(0.1 * b), "tpot": _lat(0.01 * b)}
        rec = make_record("serve", sv, mode="server", system="vllm", max_concurrency=b)
        write_json(str(res / f"srv_{b}.json"), rec)
    rows = [
        {
            "num_kv_blocks": n,
            "max_num_seqs": 4,
            "max_concurrent_requests": n // 8,
            "preemptions_per_1k_scheduled": 100.0 / n,
            "kv_utilization": 0.9,
            "kv_usage_peak": 0.8,
        }
        for n in (16, 32)
    ] + [{"num_kv_blocks": 1, "max_num_seqs": 4, "error": "too small"}]
    write_json(str(res / "cap.json"), make_record("capacity", rows))
    pre = [
        {
            "workload": "shared-prefix",
            "enable_prefix_caching": on,
            "prefix_hit_rate": 0.7 * on,
            "ttft": _lat(0.2),
            "total_tokens_per_s": 50.0,
        }
        for on in (True, False)
    ]
    write_json(str(res / "prefix.json"), make_record("prefix", pre))
    (res / "not_a_record.json").write_text(json.dumps({"x": 1}))
    records = load_records([str(res)])
    assert len(records) == 6
    assert sorted(concurrency(r) for r in records if r["benchmark"] == "serve") == [1, 8]
    paths = plot_all(records, str(tmp_path / "png"))
    names = sorted(p.rsplit("/", 1)[-1] for p in paths)
    assert names == [
        "capacity.png",
        "latency_percentiles.png",
        "prefix_cache.png",
        "throughput_vs_concurrency.png",
    ]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_all_skips_figures_without_records(tmp_path) -> None:
    rec = make_record(
        "throughput",
        {"num_requests": 2, "output_tokens_per_s": 3.0, "requests_per_s": 1.0},
        mode="offline",
    )
    assert [p.rsplit("/", 1)[-1] for p in plot_all([rec], str(tmp_path))] == [
        "throughput_vs_concurrency.png"
    ]


def test_write_json_turns_nan_into_null(tmp_path) -> None:
    path = tmp_path / "r.json"
    write_json(str(path), make_record("serve", {"ttft": {"mean": float("nan")}}))
    assert json.loads(path.read_text())["results"]["ttft"]["mean"] is None


def _timeline(n: int) -> dict:
    return {
        "t_s": [0.1 * i for i in range(n)],
        "kv_usage": [min(1.0, 0.1 * i) for i in range(n)],
        "kv_utilization": [0.9] * n,
        "num_running": [i % 4 for i in range(n)],
        "num_waiting": [0] * n,
    }


def _samples() -> dict:
    return {"ttft": [0.1, 0.2, 0.4], "tpot": [0.01, 0.02], "itl": [0.01, 0.015, 0.03], "e2e": [1.0]}


def _budget_row(alloc: str, bs: int) -> dict:
    conc = {"paged": 12, "contiguous": 4}[alloc]
    return {
        "kv_allocator": alloc,
        "block_size": bs,
        "kv_budget_tokens": 1024,
        "num_kv_blocks": 1024 // bs,
        "max_num_seqs": 64,
        "max_concurrent_requests": conc,
        "kv_utilization": 0.97 if alloc == "paged" else 0.5,
        "kv_usage_peak": 0.95,
        "preemptions_per_1k_scheduled": 3.0,
        "output_tokens_per_s": 100.0 - bs,
        "timeline": _timeline(7),
        "latency_samples": _samples(),
    }


def test_new_plots_write_pngs_from_synthetic_records(tmp_path) -> None:
    from kvserve.bench.plots import (
        plot_allocators,
        plot_block_size_sweep,
        plot_latency_cdf,
        plot_memory_timeline,
    )

    rows = [_budget_row(a, bs) for a in ("paged", "contiguous") for bs in (1, 16, 64)]
    rows.append({"kv_allocator": "paged", "block_size": 4, "kv_budget_tokens": 1024, "error": "x"})
    cap = make_record("capacity", rows)
    serve = make_record(
        "serve",
        {"num_requests": 3, "output_tokens_per_s": 5.0, "ttft": _lat(0.1)},
        mode="server",
        max_concurrency=2,
        latency_samples=_samples(),
    )
    tp = make_record(
        "throughput",
        {"num_requests": 3, "output_tokens_per_s": 4.0},
        mode="offline",
        timeline=_timeline(5),
        label="x",
    )
    records = [cap, serve, tp]
    made = [
        plot_latency_cdf(records, tmp_path / "cdf.png"),
        plot_memory_timeline(records, tmp_path / "mem.png"),
        plot_block_size_sweep(records, tmp_path / "bs.png"),
        plot_allocators(records, tmp_path / "alloc.png"),
    ]
    for p in made:
        assert p is not None
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    names = sorted(x.rsplit("/", 1)[-1] for x in plot_all(records, str(tmp_path / "all")))
    assert names == [
        "block_size_sweep.png",
        "latency_cdf.png",
        "latency_percentiles.png",
        "memory_timeline.png",
        "paged_vs_contiguous.png",
        "throughput_vs_concurrency.png",
    ]  # no --kv-blocks capacity rows, no prefix records


def test_new_plots_skip_records_without_their_data(tmp_path) -> None:
    from kvserve.bench.plots import (
        plot_allocators,
        plot_block_size_sweep,
        plot_latency_cdf,
        plot_memory_timeline,
    )

    # One allocator at one block size: no sweep, no comparison; no samples, no timeline.
    row = {k: v for k, v in _budget_row("paged", 16).items() if k not in ("timeline",)}
    row.pop("latency_samples")
    recs = [make_record("capacity", [row])]
    for fn in (plot_latency_cdf, plot_memory_timeline, plot_block_size_sweep, plot_allocators):
        assert fn(recs, tmp_path / "x.png") is None
    assert not (tmp_path / "x.png").exists()


def test_cdf_points_and_timeline_downsampling() -> None:
    import pytest

    from kvserve.bench.report import cdf_points, downsample_columns

    assert cdf_points([3.0, 1.0, 2.0]) == [1.0, 2.0, 3.0]
    thin = cdf_points([float(i) for i in range(10_001)], max_points=101)
    assert len(thin) == 101 and thin[0] == 0.0 and thin[-1] == 10_000.0 and thin[50] == 5_000.0
    cols = {"t": list(range(1000)), "u": [i * 2 for i in range(1000)]}
    small = downsample_columns(cols, max_points=500)
    assert len(small["t"]) == 500 and small["t"][0] == 0 and small["t"][-1] == 999
    assert all(u == 2 * t for t, u in zip(small["t"], small["u"], strict=True))
    assert downsample_columns({"t": [1, 2]}) == {"t": [1, 2]}
    with pytest.raises(ValueError, match="differ in length"):
        downsample_columns({"a": [1], "b": [1, 2]})
    with pytest.raises(ValueError, match="max_points"):
        cdf_points([1.0], max_points=1)


def test_offline_concurrency_is_capped_by_max_num_seqs() -> None:
    rec = {"results": {"num_requests": 64}, "engine": {"max_num_seqs": 32}}
    assert concurrency(rec) == 32
    assert concurrency({"results": {"num_requests": 8}, "engine": {"max_num_seqs": 32}}) == 8
    assert concurrency({"results": {"num_requests": 8}}) == 8
    assert concurrency({"batch_size": 4, "results": {"num_requests": 8}}) == 4


def test_goodput_plot_from_serve_records_swept_over_rates(tmp_path) -> None:
    res = tmp_path / "res"
    for label in ("no-budget", "budget"):
        for rate in (1.0, 2.0, "inf"):  # an all-at-once record is not a point of the sweep
            sv = {"num_requests": 4, "slo_attainment": 0.5, "itl": _lat(0.05), "ttft": _lat(0.3)}
            rec = make_record("serve", sv, mode="server", request_rate=rate, label=label)
            write_json(str(res / f"{label}_{rate}.json"), rec)
    paths = plot_all(load_records([str(res)]), str(tmp_path / "png"))
    assert any(p.endswith("goodput_vs_rate.png") for p in paths)
    one_rate = [r for r in load_records([str(res)]) if r["request_rate"] == 1.0]
    paths = plot_all(one_rate, str(tmp_path / "png1"))
    assert not any(p.endswith("goodput_vs_rate.png") for p in paths)


def test_latency_cdf_log_axis_labels_plain_numbers_without_minor_labels() -> None:
    """The CDF's log axes label 1-2-5 steps (or decades) in plain numbers and leave the minor
    ticks bare: matplotlib's default labelled them (``2x10^3``, ``3x10^3``...) under a decade
    or so of data, and the labels ran into each other."""
    import matplotlib.pyplot as plt

    from kvserve.bench.plots import log_ms_axis

    for lo, hi, expected in (
        (1500.0, 25000.0, {"2000", "5000", "10000", "20000"}),
        (3.0, 800.0, {"10", "100"}),
    ):
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.plot([lo, hi], [0, 1])
        log_ms_axis(ax, lo, hi)
        fig.canvas.draw()
        major = {t.get_text() for t in ax.get_xticklabels() if lo <= t.get_position()[0] <= hi}
        minor = [t.get_text() for t in ax.get_xticklabels(minor=True) if t.get_text()]
        plt.close(fig)
        assert major == expected and minor == []


def test_offline_token_gaps_pool_every_request_gap() -> None:
    """Offline runs (bench throughput, capacity) keep ITL samples: the CDF's ITL panel was
    empty for them."""
    from kvserve.bench.offline import TokenGaps
    from kvserve.outputs import CompletionOutput, RequestOutput

    def out(rid: str, tokens: int, finished: bool = False) -> RequestOutput:
        return RequestOutput(
            rid, None, [1], [CompletionOutput(0, "", list(range(tokens)))], finished=finished
        )

    gaps = TokenGaps()
    gaps.observe([out("a", 1), out("b", 0)], 1.0)  # b: prefill chunk, no token yet
    gaps.observe([out("a", 2), out("b", 1)], 1.5)
    gaps.observe([out("a", 2), out("b", 2, finished=True)], 2.25)  # a: no new token
    gaps.observe([out("a", 3, finished=True)], 3.0)
    assert gaps.gaps == [0.5, 0.75, 1.5]
