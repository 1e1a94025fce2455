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
from kvserve.engine import LLMEngine
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
