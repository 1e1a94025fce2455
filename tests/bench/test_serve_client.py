import asyncio
import math
import statistics

import pytest

from kvserve.bench.serve_client import ClientConfig, arrival_gaps, request_body, run_client
from kvserve.bench.serve_metrics import SLO, compute_metrics
from kvserve.bench.workload_args import finalize
from kvserve.sim.workloads import generate_workload
from tests.bench.fake_openai import FakeState, serve_fake


def _trace(n: int = 6, output_len: int = 4):
    reqs = generate_workload(
        "random",
        n,
        3,
        min_prompt_len=5,
        max_prompt_len=9,
        min_output_len=output_len,
        max_output_len=output_len,
    )
    return finalize(reqs, 1000)


def test_client_sends_token_prompts_and_measures_streams() -> None:
    state = FakeState(first_delay_s=0.05, gap_s=0.01)
    trace = _trace()
    with serve_fake(state) as url:
        records, duration = asyncio.run(run_client(ClientConfig(base_url=url), trace))
    assert [r.request_id for r in records] == [q.request_id for q in trace]
    assert all(r.ok and r.error is None for r in records)
    by_prompt = {tuple(b["prompt"]): b for b in state.bodies}
    for q in trace:
        body = by_prompt[tuple(q.prompt_token_ids)]
        assert body["model"] == "fake-model"  # resolved from /v1/models
        assert body["max_tokens"] == q.output_len and body["stream"] is True
        assert body["ignore_eos"] is True and body["min_tokens"] == q.output_len
    for r in records:
        assert r.num_output_tokens == 4 and len(r.chunk_times) == 4
        # The server sleeps before the first chunk and between chunks: lower bounds only.
        assert r.ttft >= 0.05 and r.e2e >= r.ttft
        assert len(r.itls) == 3 and min(r.itls) >= 0.0
    m = compute_metrics(records, duration, SLO(ttft=60.0))
    assert m["completed"] == 6 and m["num_output_tokens"] == 24
    assert m["num_good_requests"] == 6
    assert duration >= 0.05 + 3 * 0.01


def test_client_respects_max_concurrency_and_counts_chunks_without_usage() -> None:
    state = FakeState(gap_s=0.005, send_usage=False)
    with serve_fake(state) as url:
        records, _ = asyncio.run(
            run_client(ClientConfig(base_url=url, model="m", max_concurrency=2), _trace(8, 3))
        )
    assert state.peak_in_flight <= 2
    assert all(r.num_output_tokens == 3 for r in records)  # one token per text chunk
    assert {b["model"] for b in state.bodies} == {"m"}


def test_client_records_http_errors_and_backend_fields() -> None:
    state = FakeState(fail_every=2)
    with serve_fake(state) as url:
        cfg = ClientConfig(base_url=url, backend="openai", extra_body={"cache_prompt": False})
        records, duration = asyncio.run(run_client(cfg, _trace(4)))
    failed = [r for r in records if not r.ok]
    assert len(failed) == 2 and all(r.error.startswith("HTTP 500") for r in failed)
    assert all("ignore_eos" not in b and b["cache_prompt"] is False for b in state.bodies)
    m = compute_metrics(records, duration)
    assert (m["completed"], m["failed"]) == (2, 2)


def test_request_body_per_backend() -> None:
    q = _trace(1)[0]
    cfg = ClientConfig(base_url="http://x")
    assert "min_tokens" not in request_body(cfg, "m", q, "llama.cpp")
    assert request_body(cfg, "m", q, "llama.cpp")["ignore_eos"] is True
    assert request_body(ClientConfig(base_url="x", ignore_eos=False), "m", q, "vllm").keys() >= {
        "prompt",
        "max_tokens",
    }
    assert "ignore_eos" not in request_body(
        ClientConfig(base_url="x", ignore_eos=False), "m", q, "vllm"
    )


def test_arrival_gaps_deterministic_with_the_requested_mean() -> None:
    assert arrival_gaps(5, math.inf, 1.0, 0) == [0.0] * 5
    a = arrival_gaps(4000, 8.0, 1.0, 7)
    assert a == arrival_gaps(4000, 8.0, 1.0, 7) and a[0] == 0.0
    assert statistics.mean(a[1:]) == pytest.approx(1 / 8, rel=0.08)
    bursty = arrival_gaps(4000, 8.0, 0.25, 7)
    assert statistics.mean(bursty[1:]) == pytest.approx(1 / 8, rel=0.15)
    assert statistics.pstdev(bursty[1:]) > statistics.pstdev(a[1:])


def test_client_config_validation() -> None:
    with pytest.raises(ValueError, match="backend"):
        ClientConfig(base_url="x", backend="tgi")
    with pytest.raises(ValueError, match="request_rate"):
        ClientConfig(base_url="x", request_rate=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        ClientConfig(base_url="x", max_concurrency=0)


def test_static_batches_wait_for_the_whole_batch_and_count_from_arrival() -> None:
    state = FakeState(first_delay_s=0.05, gap_s=0.02)
    trace = _trace(6, 3)
    with serve_fake(state) as url:
        cfg = ClientConfig(base_url=url, model="m", static_batch_size=4)
        records, _ = asyncio.run(run_client(cfg, trace))
    assert state.peak_in_flight == 4  # all at once (rate inf): 4, then the other 2
    assert all(r.ok for r in records)
    first, second = records[:4], records[4:]
    # The second batch arrived with the first, so its TTFT holds the first batch's e2e.
    assert min(r.ttft for r in second) >= max(r.e2e for r in first)
    with pytest.raises(ValueError, match="exclude"):
        ClientConfig(base_url="x", static_batch_size=2, max_concurrency=2)
    with pytest.raises(ValueError, match="static_batch_size"):
        ClientConfig(base_url="x", static_batch_size=0)
