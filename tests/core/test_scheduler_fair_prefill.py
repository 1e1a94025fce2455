"""Fair prefill share (core/sched/fair_prefill.py, issue 51): a long prompt's chunks leave
room in every step for a newly arrived prompt, decodes always run, the long prompt still
progresses every step, and outputs do not change."""

from __future__ import annotations

import argparse
import random

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.sched.ahead import remaining_tokens
from kvserve.core.sched.fair_prefill import fair_prefill_caps
from kvserve.core.sched.step_budget import PrefillCandidate
from kvserve.engine.config import EngineConfig
from kvserve.request import Request
from tests.core.fake_runner import Driver, assert_pool_idle, make_request
from tests.core.sched_helpers import assert_expected, first_step_of, make_driver, prompt


def _caps(demands: list[int], budget: int, share: float) -> list[int] | None:
    cands = [PrefillCandidate(f"r{i}", 0, d) for i, d in enumerate(demands)]
    caps = fair_prefill_caps(cands, budget, share)
    return None if caps is None else [caps[c.request_id] for c in cands]


def test_caps_share_the_budget_then_hand_back_what_is_left() -> None:
    assert _caps([4000, 4], 512, 0.5) == [508, 4]  # the short one whole, the rest to the long
    assert _caps([4000, 4000], 512, 0.5) == [256, 256]
    assert _caps([4000, 4000, 4000], 512, 0.5) == [256, 256, 0]
    assert _caps([4000, 4000, 4, 4000], 512, 0.25) == [128 + 124, 128, 4, 128]
    # Shares go in order: two shares of 255 leave the third prompt 1 token.
    assert _caps([4000, 300, 4], 511, 0.5) == [255, 255, 1]
    assert _caps([3, 2], 1, 0.5) == [1, 0]  # the first always gets a token
    assert _caps([4000, 4], 512, 1.0) is None  # off: greedy
    assert _caps([4000], 512, 0.5) is None  # nobody else wants tokens: no cap
    assert _caps([4000, 4], 0, 0.5) is None


def test_caps_never_exceed_the_budget_or_a_demand_and_leave_nothing_takeable() -> None:
    rng = random.Random(51)
    for _ in range(2000):
        demands = [rng.choice([1, 2, 4, 30, 500, 4000]) for _ in range(rng.randint(2, 6))]
        budget = rng.randint(1, 600)
        share = rng.choice([0.1, 0.25, 0.5, 0.9])
        caps = _caps(demands, budget, share)
        assert caps is not None
        assert sum(caps) <= budget
        assert all(0 <= c <= d for c, d in zip(caps, demands, strict=True))
        assert sum(caps) == min(budget, sum(demands))  # work-conserving
        # The first candidate always gets its share (or all it can take).
        assert caps[0] >= min(demands[0], budget, max(1, int(share * budget)))


def test_prefill_share_is_validated_and_has_a_flag() -> None:
    assert SchedulerConfig().prefill_share == 0.5
    for bad in (0, 0.0, -0.5, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="prefill_share"):
            SchedulerConfig(prefill_share=bad)  # type: ignore[arg-type]
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--prefill-share", "0.25"])
    cfg = EngineConfig.from_cli_args(args)
    assert cfg.scheduler_config(8192).prefill_share == 0.25
    assert EngineConfig().scheduler_config(8192).prefill_share == 0.5
    with pytest.raises(ValueError, match="prefill_share"):
        EngineConfig(prefill_share=0.0).scheduler_config(8192)


def _long_prompt_driver(share: float) -> tuple[Driver, Request, Request]:
    """A decoding stream and a 4,000-token prompt in flight (512-token budget)."""
    d = make_driver(
        num_blocks=300,
        block_size=16,
        max_num_batched_tokens=512,
        max_model_len=8192,
        prefill_share=share,
    )
    stream = make_request("stream", prompt(4), max_tokens=40)
    long = make_request("long", prompt(4000, base=1), max_tokens=2)
    d.scheduler.add_request(stream)
    d.scheduler.add_request(long)
    d.step()
    d.step()  # the stream decodes, the long prompt is in flight
    assert long.num_computed_tokens == 512 - 4 + 511  # the stream's 4, then its decode
    return d, stream, long


def test_a_short_request_finishes_its_prefill_in_the_next_step() -> None:
    d, stream, long = _long_prompt_driver(0.5)
    short = make_request("short", prompt(4, base=2), max_tokens=3)
    d.scheduler.add_request(short)
    sched, _ = d.step()
    got = {sr.request_id: (sr.num_tokens, sr.sample) for sr in sched.scheduled}
    # Decode first, then the long prompt's share (255 of 511), the short prompt whole
    # (sampling its first token), and what is left back to the long prompt.
    assert got == {"stream": (1, True), "long": (507, False), "short": (4, True)}
    assert sched.total_num_scheduled_tokens == 512
    assert len(short.output_token_ids) == 1
    d.run()
    assert_expected(d, stream, long, short)
    assert_pool_idle(d.scheduler.kv)


def test_without_the_share_the_short_request_waits_for_the_whole_prefill() -> None:
    d, stream, long = _long_prompt_driver(1.0)
    short = make_request("short", prompt(4, base=2), max_tokens=3)
    d.scheduler.add_request(short)
    start = len(d.outputs)
    d.run()
    # 2981 prompt tokens left at 511 a step: the short prompt gets in only in the sixth
    # step, beside the long prompt's last chunk (426 tokens).
    first = first_step_of(d, "short")
    assert first - start == 5
    chunks = {sr.request_id: sr.num_tokens for sr in d.outputs[first].scheduled}
    assert chunks == {"stream": 1, "long": 426, "short": 4}
    assert_expected(d, stream, long, short)


@pytest.mark.parametrize("share", [0.5, 0.25, 0.9])
def test_decodes_run_and_the_oldest_prefill_progresses_every_step(share: float) -> None:
    """Two long prompts and a stream of short arrivals: every step carries every decode,
    the oldest unfinished prefill gets at least its share, within the budget."""
    budget = 64
    d = make_driver(
        num_blocks=400,
        block_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=budget,
        max_model_len=1024,
        prefill_share=share,
    )
    s = d.scheduler
    rng = random.Random(7)
    reqs = [make_request("long0", prompt(600), max_tokens=3)]
    reqs.append(make_request("long1", prompt(500, base=1), max_tokens=3))
    for r in reqs:
        s.add_request(r)
    for i in range(60):
        if i % 2 == 0 and i < 40:
            r = make_request(f"s{i}", prompt(rng.randint(2, 40), base=i + 2), max_tokens=6)
            reqs.append(r)
            s.add_request(r)
        decoding = {r.request_id for r in s.running if remaining_tokens(r) == 1}
        prefilling = sorted(
            (r for r in s.running if remaining_tokens(r) > 1), key=s.policy.sort_key
        )
        want = remaining_tokens(prefilling[0]) if prefilling else 0
        sched, _ = d.step()
        scheduled = {sr.request_id: sr.num_tokens for sr in sched.scheduled}
        assert decoding <= scheduled.keys(), "a decode was starved"
        left = budget - len(decoding)
        if prefilling:  # the oldest running prefill gets its share (or all it needs)
            got = scheduled.get(prefilling[0].request_id, 0)
            assert got >= min(want, left, max(1, int(share * left))), prefilling[0].request_id
    assert s.totals.preemptions == 0
    d.run()
    assert_expected(d, *reqs)
    assert_pool_idle(s.kv)


def test_a_waiting_prompt_is_charged_only_its_uncached_tokens() -> None:
    d = make_driver(num_blocks=64, max_num_batched_tokens=16)
    s = d.scheduler
    first = make_request("first", prompt(40), max_tokens=1)
    s.add_request(first)
    d.run()  # its 40-token prompt is now cached (36 tokens hit: the last is recomputed)
    long = make_request("long", prompt(100, base=1), max_tokens=1)
    s.add_request(long)
    d.step()
    again = make_request("again", prompt(40), max_tokens=1)
    s.add_request(again)
    sched, _ = d.step()
    got = {sr.request_id: sr.num_tokens for sr in sched.scheduled}
    # The long prompt's share (8), the 4 tokens the hit leaves, the rest back: nothing unused.
    assert got == {"long": 12, "again": 4}
    d.run()
    assert_expected(d, first, long, again)
    assert_pool_idle(s.kv)
