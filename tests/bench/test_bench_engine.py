"""bench throughput / capacity helpers on the embedded model with tiny traces."""

import argparse
import dataclasses
import json

import pytest

from kvserve.bench.capacity import format_table, sweep_points
from kvserve.bench.cli import register
from kvserve.bench.offline import run_offline
from kvserve.bench.workload_args import finalize
from kvserve.cli import _engine_parser
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sim.workloads import generate_workload


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvserve")
    register(parser.add_subparsers(dest="command", required=True), _engine_parser)
    args = parser.parse_args(argv)
    return args.func(args)


def test_bench_throughput_reports_the_fields(tmp_path, capsys) -> None:
    out = tmp_path / "tp.json"
    rc = _run_cli(
        [
            "bench",
            "throughput",
            "--num-prompts",
            "3",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--num-kv-blocks",
            "64",
            "--max-num-seqs",
            "2",
            "--num-threads",
            "2",
            "--quiet",
            "--no-warmup",
            "--step-thread",
            "--output-json",
            str(out),
        ]
    )
    assert rc == 0
    rec = json.loads(out.read_text())
    assert rec["benchmark"] == "throughput" and rec["system"] == "kvserve"
    assert rec["mode"] == "offline, step thread" and rec["engine"]["max_num_seqs"] == 2
    r = rec["results"]
    assert r["num_requests"] == 3 and r["num_output_tokens"] == 12  # EOS ignored
    assert r["num_prompt_tokens"] == 24
    for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
        assert r[key] > 0
    assert r["total_tokens_per_s"] == pytest.approx(r["output_tokens_per_s"] * 36 / 12)
    assert 1 <= r["max_concurrent_requests"] <= 2  # max_num_seqs caps it
    assert 0 < r["kv_usage_peak"] <= 1 and 0 < r["kv_utilization"] <= 1
    assert r["prefix_hit_rate"] == 0.0 and r["preemptions"] >= 0
    assert r["ttft"]["count"] == 3 and r["num_kv_blocks"] == 64
    assert "output_tokens_per_s" in capsys.readouterr().out


def test_shared_prefix_run_hits_the_cache() -> None:
    engine = LLMEngine(num_kv_blocks=64, num_threads=2)
    vocab = engine.arch.vocab_size
    trace = finalize(
        generate_workload(
            "shared-prefix",
            4,
            0,
            vocab_size=vocab,
            num_groups=1,
            prefix_len=48,
            suffix_len=4,
            output_len=2,
        ),
        vocab,
    )
    run = run_offline(engine, trace)
    f = run.figures
    assert [len(o.outputs[0].token_ids) for o in run.outputs] == [2] * 4
    assert [o.prompt_token_ids for o in run.outputs] == [r.prompt_token_ids for r in trace]
    # The first request computes the 3 full prefix blocks; the other three reuse them.
    assert f["prefix_hit_rate"] > 0.5 and f["num_cached_prompt_tokens"] >= 3 * 48
    # ITL: one gap per request (2 tokens each), what the CDF plot's ITL panel draws.
    assert len(run.latency_samples["itl"]) == 4 and min(run.latency_samples["itl"]) > 0
    with pytest.raises(ValueError, match="max_concurrency"):
        run_offline(engine, trace, max_concurrency=0)
    # Replay: the second request is queued only once its arrival time has passed.
    late = [
        dataclasses.replace(trace[0], request_id="a"),
        dataclasses.replace(trace[1], request_id="b", arrival_time=0.3),
    ]
    replay = run_offline(engine, late, replay_arrivals=True, max_concurrency=1)
    assert replay.figures["elapsed_s"] >= 0.3 and replay.figures["num_output_tokens"] == 4
    assert replay.figures["max_concurrent_requests"] == 1


def test_capacity_sweep_grid_and_table() -> None:
    assert sweep_points([8, 16], [1, 4]) == [(8, 1), (8, 4), (16, 1), (16, 4)]
    with pytest.raises(ValueError, match=">= 1"):
        sweep_points([0], [1])
    table = format_table([{"num_kv_blocks": 8, "max_num_seqs": 2, "kv_usage_peak": 0.5}])
    assert "blocks" in table.splitlines()[0] and "0.500" in table.splitlines()[1]


def test_capacity_grid_budget_and_ratios() -> None:
    from kvserve.bench.capacity import SweepPoint, allocator_ratios, format_ratios, sweep_grid

    grid = sweep_grid(
        allocators=["paged", "contiguous"],
        block_sizes=[1, 16, 64],
        max_seqs=[8],
        kv_budget_tokens=[1024],
    )
    # Same memory at every block size: budget // block_size blocks; allocators innermost.
    assert [(p.kv_allocator, p.block_size, p.num_kv_blocks) for p in grid] == [
        ("paged", 1, 1024),
        ("contiguous", 1, 1024),
        ("paged", 16, 64),
        ("contiguous", 16, 64),
        ("paged", 64, 16),
        ("contiguous", 64, 16),
    ]
    assert grid[0] == SweepPoint("paged", 1, 1024, 8, kv_budget_tokens=1024)
    blocks = sweep_grid(allocators=["paged"], block_sizes=[16], max_seqs=[2, 4], kv_blocks=[32])
    assert [(p.num_kv_blocks, p.max_num_seqs, p.kv_budget_tokens) for p in blocks] == [
        (32, 2, None),
        (32, 4, None),
    ]
    with pytest.raises(ValueError, match="exactly one"):
        sweep_grid(allocators=["paged"], block_sizes=[16], max_seqs=[1])
    with pytest.raises(ValueError, match="holds no block"):
        sweep_grid(allocators=["paged"], block_sizes=[64], max_seqs=[1], kv_budget_tokens=[32])
    with pytest.raises(ValueError, match="allocator must be"):
        sweep_grid(allocators=["buddy"], block_sizes=[16], max_seqs=[1], kv_blocks=[8])
    rows = [
        {
            "kv_allocator": a,
            "kv_budget_tokens": 1024,
            "num_kv_blocks": 64,
            "block_size": 16,
            "max_num_seqs": 8,
            "max_concurrent_requests": c,
            "mean_running_requests": m,
            "kv_utilization": u,
            "num_requests": 8,
        }
        for a, c, m, u in (("paged", 8, 5.0, 0.98), ("contiguous", 2, 2.5, 0.4))
    ] + [{"kv_allocator": "paged", "block_size": 1, "error": "x"}]
    (ratio,) = allocator_ratios(rows)
    assert ratio["concurrency_ratio"] == 4.0 and ratio["mean_concurrency_ratio"] == 2.0
    assert ratio["paged_capped_by_max_num_seqs"] and ratio["paged_ran_every_request"]
    text = format_ratios([ratio])
    assert "8 / 2 = 4.00x" in text and "capped by max_num_seqs" in text
    assert "5.0 / 2.5 = 2.00x" in text and "lower bound" in text


def test_max_tokens_cap_ends_requests_at_their_trace_length() -> None:
    engine = LLMEngine(num_kv_blocks=64, num_threads=2, kv_allocator="contiguous")
    trace = finalize(
        generate_workload(
            "random",
            3,
            0,
            vocab_size=engine.arch.vocab_size,
            min_prompt_len=5,
            max_prompt_len=9,
            min_output_len=2,
            max_output_len=4,
        ),
        engine.arch.vocab_size,
    )
    exact = run_offline(engine, trace)
    capped = run_offline(engine, trace, max_tokens=40)
    assert [o.outputs[0].token_ids for o in capped.outputs] == [
        o.outputs[0].token_ids for o in exact.outputs
    ]
    assert [len(o.outputs[0].token_ids) for o in capped.outputs] == [r.output_len for r in trace]
    assert all(o.finished and o.outputs[0].finish_reason == "stop" for o in capped.outputs)
    assert all(o.metrics.e2e >= o.metrics.ttft > 0 for o in capped.outputs)
    # The contiguous allocator reserved prompt + 40 tokens instead of prompt + output_len.
    assert capped.figures["kv_utilization"] < exact.figures["kv_utilization"]
    assert engine.stats()["kv_usage"] == 0
    tl = capped.timeline
    assert len(tl["t_s"]) == capped.figures["num_steps"] and max(tl["num_running"]) >= 1
    assert tl["t_s"] == sorted(tl["t_s"])
    assert len(capped.latency_samples["ttft"]) == 3
    assert len(capped.latency_samples["itl"]) == sum(r.output_len - 1 for r in trace)
    with pytest.raises(ValueError, match="max_tokens"):
        run_offline(engine, trace, max_tokens=0)


def test_bench_capacity_compares_allocators_at_one_budget(tmp_path, capsys) -> None:
    out = tmp_path / "cap.json"
    argv = ["bench", "capacity", "--kv-budget-tokens", "256", "--allocators", "paged"]
    argv += ["contiguous", "--block-sizes", "16", "--num-prompts", "3", "--input-len", "8"]
    argv += ["--output-len", "3", "--max-tokens", "24", "--num-threads", "2", "--quiet"]
    assert _run_cli([*argv, "--no-warmup", "--output-json", str(out)]) == 0
    rec = json.loads(out.read_text())
    rows = rec["results"]
    assert [(r["kv_allocator"], r["num_kv_blocks"]) for r in rows] == [
        ("paged", 16),
        ("contiguous", 16),
    ]
    for r in rows:
        assert r["num_output_tokens"] == 9 and r["kv_budget_tokens"] == 256
        assert r["kv_budget_bytes"] == 256 * r["kv_bytes_per_token"]
        assert len(r["timeline"]["kv_usage"]) == r["num_steps"]
    # 3 x 8-token prompts fit paged at once (1 block each); contiguous reserves 8 + 24 = 2
    # blocks each, which also fit: both run all 3.
    (ratio,) = rec["ratios"]
    assert (
        ratio["paged_max_concurrent_requests"] == 3 == ratio["contiguous_max_concurrent_requests"]
    )
    assert rows[1]["kv_utilization"] < rows[0]["kv_utilization"]
    assert "paged/contiguous max concurrency" in capsys.readouterr().out
