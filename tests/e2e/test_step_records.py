"""LLMEngine.step_records split each step's wall time into schedule / execute / the rest."""

from __future__ import annotations

from collections.abc import Callable

from kvserve.sampling_params import SamplingParams


def test_step_records_split_schedule_and_execute_time(make_llm: Callable[..., object]) -> None:
    llm = make_llm(max_num_batched_tokens=32, num_kv_blocks=64)
    engine = llm.engine  # type: ignore[attr-defined]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request(list(range(100, 140)), params)  # 40 tokens: two prefill chunks
    engine.add_request(list(range(200, 209)), params)
    num_before = len(engine.step_records)
    while engine.has_unfinished_requests():
        engine.step()
    records = engine.step_records[num_before:]
    assert sum(r["num_prefill_tokens"] + r["num_decode_tokens"] for r in records) == 40 + 9 + 4
    for r in records:
        assert r["schedule_seconds"] >= 0.0 and r["execute_seconds"] > 0.0
        # Both are measured inside the step, so they never exceed the step's wall time.
        assert r["schedule_seconds"] + r["execute_seconds"] <= r["seconds"]
