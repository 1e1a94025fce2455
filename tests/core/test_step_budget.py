"""The step-time budget planner with a fake (exact) cost model, alone and in the scheduler."""

from __future__ import annotations

import logging

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.outputs import SchedulerOutput
from kvserve.core.sched.scheduler import Scheduler
from kvserve.core.sched.step_budget import PrefillCandidate, StepBudgetConfig, StepTimeBudget
from kvserve.core.sched.step_cost import StepLoad
from kvserve.engine.config import EngineConfig
from tests.core.fake_runner import Driver, FakeClock, FakeRunner, expected_output, make_request

VOCAB = 50
OVERHEAD_S = 0.010
TOKEN_S = 0.001


class FakeCost:
    """10 ms a step plus 1 ms a token (decode or prefill), ready from the start."""

    ready = True

    def __init__(self) -> None:
        self.observed: list[tuple[StepLoad, float]] = []

    def predict(self, load: StepLoad) -> float:
        return OVERHEAD_S + TOKEN_S * (load.num_decode_tokens + load.num_prefill_tokens)

    def observe(self, load: StepLoad, seconds: float) -> None:
        self.observed.append((load, seconds))


def make(
    policy: str = "shortest", *, budget: int = 64, prefill_share: float = 0.5, **cfg: object
) -> Driver:
    cfg.setdefault("max_step_ms", 30.0)
    cfg.setdefault("ttft_aging", 0.0)  # the fixed target (the TTFT guard: test_step_budget_guard)
    step_budget = StepTimeBudget(
        StepBudgetConfig(prefill_policy=policy, **cfg),  # type: ignore[arg-type]
        FakeCost(),
    )
    kv = KVCacheManager(128, 4, enable_prefix_caching=False)
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=512,
        admission_headroom=0.0,
        resume_watermark=0.0,
        prefill_share=prefill_share,
    )
    clock = FakeClock()
    scheduler = Scheduler(config, kv, clock=clock, step_budget=step_budget)
    return Driver(scheduler, FakeRunner(128, 4, 0, VOCAB), clock)


def prompt(n: int, base: int) -> list[int]:
    return [(base * 7 + 3 * i + 1) % VOCAB for i in range(n)]


def layout(sched: SchedulerOutput) -> list[tuple[str, int]]:
    return [(sr.request_id, sr.num_tokens) for sr in sched.scheduled]


def step_seconds(sched: SchedulerOutput) -> float:
    """The fake model's time of an executed step."""
    return OVERHEAD_S + TOKEN_S * sched.total_num_scheduled_tokens


def run_script(d: Driver, arrivals: dict[int, list[tuple[str, int, int]]], num_steps: int):
    """Add (id, prompt length, max_tokens) before the given steps; the layouts of the steps."""
    out = []
    for i in range(num_steps):
        for rid, n, max_tokens in arrivals.get(i, []):
            d.scheduler.add_request(make_request(rid, prompt(n, len(rid)), max_tokens=max_tokens))
        sched, _ = d.step()
        out.append(layout(sched))
    return out


# D decodes from step 1; a long prompt L arrives at step 1, a short S at step 2.
ARRIVALS = {0: [("D", 8, 20)], 1: [("L", 100, 4)], 2: [("S", 12, 4)]}


def test_shortest_remaining_lets_a_short_prompt_pass_a_long_one() -> None:
    steps = run_script(make("shortest"), ARRIVALS, 5)
    assert steps == [
        [("D", 8)],  # lone prefill: the whole token budget, no stream to protect
        [("D", 1), ("L", 19)],  # 10 ms + 1 decode + 19 prefill tokens = 30 ms
        [("D", 1), ("L", 7), ("S", 12)],  # S (12 left) before L (81 left)
        [("D", 1), ("S", 1), ("L", 18)],
        [("D", 1), ("S", 1), ("L", 18)],
    ]


def test_fcfs_holds_the_short_prompt_behind_the_long_one() -> None:
    steps = run_script(make("fcfs"), ARRIVALS, 8)
    assert steps[2:6] == [[("D", 1), ("L", 19)]] * 4  # S waits while L takes every step
    assert steps[6] == [("D", 1), ("L", 5), ("S", 12)]  # 100 = 5 x 19 + 5
    assert steps[7] == [("D", 1), ("L", 1), ("S", 1)]


def test_round_robin_serves_the_least_recently_served_first() -> None:
    b = StepTimeBudget(StepBudgetConfig(max_step_ms=30.0, prefill_policy="round-robin"), FakeCost())
    a_, b_ = PrefillCandidate("A", 0, 50), PrefillCandidate("B", 0, 40)
    plans = [b.plan([5], [a_, b_], 64) for _ in range(4)]
    # One decode: 11 ms, 19 tokens of room; the leader alternates.
    assert plans == [{"A": 19, "B": 0}, {"A": 0, "B": 19}, {"A": 19, "B": 0}, {"A": 0, "B": 19}]
    s = StepTimeBudget(StepBudgetConfig(max_step_ms=30.0, prefill_policy="shortest"), FakeCost())
    assert [s.plan([5], [a_, b_], 64) for _ in range(2)] == [{"A": 0, "B": 19}] * 2


def test_waiting_requests_keep_queue_order_whatever_the_policy() -> None:
    b = StepTimeBudget(StepBudgetConfig(max_step_ms=30.0), FakeCost())
    long_w = PrefillCandidate("W1", 0, 30, waiting=True)
    short_w = PrefillCandidate("W2", 0, 5, waiting=True)
    running = PrefillCandidate("R", 10, 8)
    # Shortest first would be W2, R, W1; W2's slot goes to the queue head W1.
    assert b.plan([5], [running, long_w, short_w], 64) == {"R": 0, "W1": 19, "W2": 0}


def test_never_exceeds_the_target_and_never_starves_decodes() -> None:
    d = make("shortest", budget=48)
    arrivals = {
        0: [("a", 30, 12)],
        1: [("b", 90, 10), ("c", 7, 6)],
        3: [("d", 45, 9)],
        4: [("e", 3, 5), ("f", 60, 8)],
        9: [("g", 120, 4)],
    }
    requests = {}
    for i in range(400):
        for rid, n, max_tokens in arrivals.get(i, []):
            req = make_request(rid, prompt(n, len(rid) + i), max_tokens=max_tokens)
            requests[rid] = (req, expected_output(req, d.scheduler, VOCAB))
            d.scheduler.add_request(req)
        if i > 9 and not d.scheduler.has_unfinished_requests():
            break
        decoding = {
            r.request_id for r in d.scheduler.running if r.num_tokens - r.num_computed_tokens == 1
        }
        sched, _ = d.step()
        ids = {sr.request_id for sr in sched.scheduled}
        assert decoding <= ids, f"step {i}: decodes {decoding - ids} starved"
        if decoding:
            assert step_seconds(sched) <= 0.030 + 1e-12, f"step {i}: {layout(sched)}"
    assert not d.scheduler.has_unfinished_requests()
    for req, want in requests.values():
        assert req.output_token_ids == want
    stats = d.scheduler.stats()
    assert stats["step_budget_capped_steps"] > 0
    assert stats["step_budget_min_chunk_steps"] == 0


def test_lone_prefill_takes_the_whole_token_budget() -> None:
    d = make("shortest", budget=64, max_step_ms=12.0)
    steps = run_script(d, {0: [("A", 150, 2), ("B", 20, 2)]}, 4)
    # No decodes run: the chunks are token-budget sized, far above 12 ms, and the budget
    # leaves the step to the fair prefill share (half of 64 first, then the rest).
    # B's decode in step 1 leaves 1 ms of the 12: A gets 1 token; then A is alone again.
    assert steps == [[("A", 44), ("B", 20)], [("B", 1), ("A", 1)], [("A", 64)], [("A", 41)]]
    b = StepTimeBudget(StepBudgetConfig(max_step_ms=1.0), FakeCost())
    assert b.plan([], [PrefillCandidate("A", 0, 500)], 64) is None


def test_target_below_the_decode_step_warns_and_advances_by_a_minimum_chunk(
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = make("shortest", budget=64, max_step_ms=5.0, min_prefill_chunk=8)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        steps = run_script(d, {0: [("D", 8, 30)], 1: [("L", 40, 3)]}, 7)
    assert steps[1:6] == [[("D", 1), ("L", 8)]] * 5
    assert steps[6] == [("D", 1), ("L", 1)]
    warnings = [r for r in caplog.records if "below the predicted pure-decode step" in r.message]
    assert len(warnings) == 1  # once, not every step
    stats = d.scheduler.stats()
    assert stats["step_budget_over_target_steps"] == 5
    assert stats["step_budget_min_chunk_steps"] == 5


def test_no_fit_yet_means_no_cap() -> None:
    b = StepTimeBudget(StepBudgetConfig(max_step_ms=1.0))  # the online model, empty
    assert b.plan([5, 9], [PrefillCandidate("A", 0, 500)], 64) is None


def test_default_target_is_a_multiple_of_the_predicted_decode_step() -> None:
    b = StepTimeBudget(StepBudgetConfig(decode_multiple=2.0), FakeCost())
    # 4 decodes: 14 ms; target 28 ms: 14 prefill tokens.
    assert b.plan([3, 3, 3, 3], [PrefillCandidate("A", 0, 100)], 64) == {"A": 14}
    assert b.last_target_s == pytest.approx(0.028)
    assert b.plan([3, 3, 3, 3], [PrefillCandidate("A", 0, 100)], 9) == {"A": 9}  # token cap


def test_target_itl_subtracts_the_measured_gap_between_busy_steps() -> None:
    now = [0.0]
    b = StepTimeBudget(
        StepBudgetConfig(target_itl_ms=40.0, skip_first=0), FakeCost(), clock=lambda: now[0]
    )
    rec = {
        "num_decode_tokens": 2,
        "num_prefill_tokens": 0,
        "num_context_tokens": 20,
        "num_seqs": 2,
        "seconds": 0.012,
    }
    for _ in range(100):
        now[0] += 0.017  # 12 ms steps, 5 ms between them
        b.observe(rec)
    assert b.gap_s == pytest.approx(0.005, rel=1e-3)
    assert b.target_s(0.012) == pytest.approx(0.035, rel=1e-3)


@pytest.mark.parametrize(
    ("field", "flag"),
    [
        ("max_step_ms", "--max-step-ms"),
        ("target_itl_ms", "--target-itl-ms"),
        ("step_decode_multiple", "--step-decode-multiple"),
    ],
)
@pytest.mark.parametrize("value", [0, -5.0, float("nan")])
def test_non_positive_values_name_the_flag(field: str, flag: str, value: float) -> None:
    with pytest.raises(ValueError, match=flag):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


def test_bad_combinations_are_value_errors() -> None:
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(max_step_ms=50.0, target_itl_ms=60.0)
    # A step-time target turns the (default-off) budget on.
    assert EngineConfig(max_step_ms=50.0).step_budget
    assert not EngineConfig().step_budget
    with pytest.raises(ValueError, match="--prefill-policy"):
        EngineConfig(prefill_policy="lifo")
    # A target below any plausible decode step is accepted (the warning comes at run time).
    assert EngineConfig(max_step_ms=0.001).step_budget_config().max_step_ms == 0.001
