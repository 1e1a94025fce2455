"""The step budget's TTFT guard: aging of waiting prompts and the few-decodes gate (exact)."""

from __future__ import annotations

import argparse

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.sched.scheduler import Scheduler
from kvserve.core.sched.step_budget import PrefillCandidate, StepBudgetConfig, StepTimeBudget
from kvserve.engine.config import EngineConfig
from tests.core.fake_runner import FakeClock, FakeRunner, expected_output, make_request
from tests.core.test_step_budget import VOCAB, FakeCost, layout, prompt, step_seconds


def budget(**cfg: object) -> StepTimeBudget:
    cfg.setdefault("max_step_ms", 30.0)
    return StepTimeBudget(StepBudgetConfig(**cfg), FakeCost())  # type: ignore[arg-type]


def test_aging_stretches_the_step_by_the_time_the_prompt_has_waited() -> None:
    b = budget(ttft_aging=1.0)
    # One decode (11 ms): the 30 ms target leaves 19 prefill tokens.
    assert b.plan([5], [PrefillCandidate("A", 0, 100, waiting=True)], 64) == {"A": 19}
    # Waited 10 ms: the step may take 40 ms -> 29 tokens.
    assert b.plan([5], [PrefillCandidate("A", 0, 100, True, 0.010)], 64) == {"A": 29}
    # Waited long: only the token budget bounds it (63 tokens left beside the decode).
    assert b.plan([5], [PrefillCandidate("A", 0, 100, True, 5.0)], 63) == {"A": 63}
    assert b.stats()["step_budget_aged_steps"] == 2
    half = budget(ttft_aging=0.5)
    assert half.plan([5], [PrefillCandidate("A", 0, 100, True, 0.010)], 64) == {"A": 24}
    fixed = budget(ttft_aging=0.0)
    assert fixed.plan([5], [PrefillCandidate("A", 0, 100, True, 5.0)], 64) == {"A": 19}
    assert fixed.stats()["step_budget_aged_steps"] == 0


def test_aging_is_per_prompt_and_adds_to_what_the_others_took() -> None:
    b = budget(ttft_aging=1.0)
    fresh = PrefillCandidate("S", 20, 8)  # shortest first; already has its first token
    old = PrefillCandidate("L", 0, 200, True, 0.020)
    # S: 8 tokens (19 ms); L may take the step to 50 ms: 50 - 10 - 1 - 8 = 31 tokens.
    assert b.plan([5], [old, fresh], 64) == {"L": 31, "S": 8}
    # Without the old prompt nobody exceeds the plain target.
    assert b.plan([5], [PrefillCandidate("S2", 0, 40)], 64) == {"S2": 19}


def test_a_prompt_past_its_ttft_deadline_is_not_capped() -> None:
    b = budget(ttft_aging=0.0, ttft_slack=1.0)
    # Unsplit: 10 ms + 1 decode + 64 tokens (the token budget) = 75 ms; deadline 1.0 x 75 ms.
    assert b.plan([5], [PrefillCandidate("A", 0, 100, True, 0.070)], 64) == {"A": 19}
    assert b.plan([5], [PrefillCandidate("A", 0, 100, True, 0.075)], 64) == {"A": 64}
    # Already streaming (waited 0: its TTFT is behind it): the plain target.
    assert b.plan([5], [PrefillCandidate("A", 30, 70)], 64) == {"A": 19}
    # Two prompts: only the late one passes the target, on top of what the other took.
    late, fresh = PrefillCandidate("L", 0, 40, True, 0.2), PrefillCandidate("S", 0, 10, True)
    assert budget(ttft_aging=0.0, ttft_slack=1.0).plan([5], [late, fresh], 64) == {"L": 40, "S": 0}


def test_deadline_multiple_bounds_the_step_of_a_late_prompt() -> None:
    # Issue 51: past its deadline a prompt may take the step to 3 x the 11 ms decode step
    # (33 ms: 22 tokens), not the whole token budget; before it, the plain 30 ms target.
    b = budget(ttft_aging=0.0, ttft_slack=1.0, deadline_multiple=3.0)
    assert b.plan([5], [PrefillCandidate("A", 0, 100, True, 0.070)], 64) == {"A": 19}
    assert b.plan([5], [PrefillCandidate("A", 0, 100, True, 0.075)], 64) == {"A": 22}
    # A multiple whose step is under the target never shrinks the target's chunk.
    low = budget(ttft_aging=0.0, ttft_slack=1.0, deadline_multiple=2.0)
    assert low.plan([5], [PrefillCandidate("A", 0, 100, True, 0.075)], 64) == {"A": 19}
    # Three decodes (13 ms) and a late prompt: 39 ms - 13 ms = 26 tokens.
    assert b.plan([5, 5, 5], [PrefillCandidate("A", 0, 100, True, 1.0)], 64) == {"A": 26}


def test_engine_default_bounds_a_late_prompt_and_none_lifts_it() -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    default = EngineConfig.from_cli_args(parser.parse_args([]))
    assert default.step_budget_config().deadline_multiple == 2.5
    off = EngineConfig.from_cli_args(parser.parse_args(["--step-deadline-multiple", "none"]))
    assert off.step_budget_config().deadline_multiple is None
    no_deadline = EngineConfig.from_cli_args(parser.parse_args(["--ttft-slack", "None"]))
    assert no_deadline.ttft_slack is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--step-deadline-multiple", "lots"])


def test_few_decodes_leave_the_step_uncapped() -> None:
    b = budget(min_decodes=3)
    a = PrefillCandidate("A", 0, 100)
    assert b.plan([5, 5], [a], 64) is None  # two streams: no cap, the token budget rules
    assert b.plan([5, 5, 5], [a], 64) == {"A": 17}  # three: 13 ms of decodes, 17 tokens
    stats = b.stats()
    assert stats["step_budget_few_decode_steps"] == 1
    assert stats["step_budget_capped_steps"] == 1


def run_timed(aging: float, num_steps: int) -> tuple[list[list[tuple[str, int]]], float]:
    """D decodes from step 1, L (100 tokens) arrives after step 0; the clock follows the steps.

    Returns the step layouts and L's TTFT (arrival -> end of the step that sampled it).
    """
    clock = FakeClock()
    step_budget = StepTimeBudget(
        StepBudgetConfig(max_step_ms=30.0, ttft_aging=aging), FakeCost(), clock=clock
    )
    kv = KVCacheManager(128, 4, enable_prefix_caching=False)
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=512,
        admission_headroom=0.0,
        resume_watermark=0.0,
    )
    scheduler = Scheduler(config, kv, clock=clock, step_budget=step_budget)
    runner = FakeRunner(128, 4, 0, VOCAB)
    d = make_request("D", prompt(8, 1), max_tokens=30, arrival_time=0.0)
    scheduler.add_request(d)
    want_d = expected_output(d, scheduler, VOCAB)
    layouts, ttft, arrival = [], float("nan"), 0.0
    for i in range(num_steps):
        if i == 1:
            arrival = clock.now
            scheduler.add_request(
                make_request("L", prompt(100, 2), max_tokens=3, arrival_time=arrival)
            )
        sched = scheduler.schedule()
        scheduler.update_from_output(sched, runner.execute(sched))
        clock.now += step_seconds(sched)
        layouts.append(layout(sched))
        if any(sr.request_id == "L" and sr.sample for sr in sched.scheduled) and ttft != ttft:
            ttft = clock.now - arrival
    assert d.output_token_ids[: len(want_d)] == want_d[: len(d.output_token_ids)]
    return layouts, ttft


def test_a_waiting_prompt_gets_a_growing_chunk_and_a_bounded_ttft() -> None:
    layouts, ttft = run_timed(1.0, 4)
    assert layouts == [
        [("D", 8)],
        [("D", 1), ("L", 19)],  # waited 0: the plain 30 ms target
        [("D", 1), ("L", 49)],  # waited 30 ms: up to 60 ms
        [("D", 1), ("L", 32)],  # waited 90 ms: the rest fits (43 ms)
    ]
    assert ttft == pytest.approx(0.030 + 0.060 + 0.043)
    fixed, fixed_ttft = run_timed(0.0, 7)
    assert fixed[1:6] == [[("D", 1), ("L", 19)]] * 5  # 5 x 19 + 5 = 100
    assert fixed[6] == [("D", 1), ("L", 5)]
    assert fixed_ttft == pytest.approx(5 * 0.030 + 0.016)
    assert ttft < fixed_ttft


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("ttft_aging", -1.0, "--ttft-aging"),
        ("ttft_aging", float("inf"), "--ttft-aging"),
        ("step_min_decodes", 0, "--step-min-decodes"),
        ("ttft_slack", -0.5, "--ttft-slack"),
        ("step_deadline_multiple", 0.5, "--step-deadline-multiple"),
    ],
)
def test_bad_guard_values_name_the_flag(field: str, value: float, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


def test_engine_config_passes_the_guard_through() -> None:
    cfg = EngineConfig(ttft_aging=0.5, step_min_decodes=3, ttft_slack=2.0).step_budget_config()
    assert (cfg.ttft_aging, cfg.min_decodes, cfg.ttft_slack) == (0.5, 3, 2.0)


def test_a_prompt_the_step_completes_bounds_the_stretch_for_an_older_one() -> None:
    # Issue 51: a 4-token request arriving beside a long prompt that has waited 0.5 s.
    short = PrefillCandidate("S", 0, 4, True, 0.001)
    old = PrefillCandidate("L", 0, 200, False, 0.5)
    # Alone, L's aging lets it take the rest of the token budget (63 beside the decode).
    assert budget(ttft_aging=1.0).plan([5], [old], 63) == {"L": 63}
    # With S (shortest first, done in this step): L stretches the step by S's 1 ms only:
    # 31 ms - 10 - 1 decode - 4 = 16 tokens.
    assert budget(ttft_aging=1.0).plan([5], [old, short], 63) == {"L": 16, "S": 4}
    # The deadline likewise: L is past it (0.5 s >= 1 x 74 ms), S is not: the plain target.
    assert budget(ttft_aging=0.0, ttft_slack=1.0).plan([5], [old], 63) == {"L": 63}
    assert budget(ttft_aging=0.0, ttft_slack=1.0).plan([5], [old, short], 63) == {"L": 15, "S": 4}
    # A prompt the step only chunks gets no first token now: it bounds nothing.
    part = PrefillCandidate("P", 0, 100, True, 0.001)
    assert budget(ttft_aging=1.0).plan([5], [old, part], 63)["L"] > 16
