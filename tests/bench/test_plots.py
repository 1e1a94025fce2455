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
