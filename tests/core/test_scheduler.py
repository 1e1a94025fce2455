"""Scheduler unit tests: a FakeRunner (simulated paged cache) or hand-built runner outputs."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.sched.policy import PreemptionPolicy, SortKey
from kvserve.core.sched.scheduler import Scheduler
from kvserve.request import Request, RequestStatus
from tests.core.fake_runner import (
    Driver,
    FakeClock,
    FakeRunner,
    assert_pool_idle,
    expected_output,
    make_request,
    runner_output,
)

VOCAB = 50


def make_driver(
    num_blocks: int = 16,
    block_size: int = 4,
    *,
    num_host_blocks: int = 0,
    enable_prefix_caching: bool = True,
    policy: PreemptionPolicy | None = None,
    **config: object,
) -> Driver:
    settings: dict = dict(
        max_num_seqs=8,
        max_num_batched_tokens=16,
        max_model_len=256,
        admission_headroom=0.0,
    )
    settings.update(config)
    settings.setdefault("resume_watermark", settings["admission_headroom"])
    kv = KVCacheManager(
        num_blocks,
        block_size,
        enable_prefix_caching=enable_prefix_caching,
        num_host_blocks=num_host_blocks,
    )
    clock = FakeClock()
    scheduler = Scheduler(SchedulerConfig(**settings), kv, policy=policy, clock=clock)
    return Driver(scheduler, FakeRunner(num_blocks, block_size, num_host_blocks, VOCAB), clock)


def prompt(n: int, base: int = 0) -> list[int]:
    return [(base * 7 + 3 * i + 1) % VOCAB for i in range(n)]


def scheduled_ids(d: Driver, step: int) -> set[str]:
    return {sr.request_id for sr in d.outputs[step].scheduled}


def first_step_of(d: Driver, request_id: str) -> int:
    return next(
        i for i, o in enumerate(d.outputs) if request_id in {s.request_id for s in o.scheduled}
    )


def assert_expected(d: Driver, *requests: Request) -> None:
    for r in requests:
        assert r.output_token_ids == expected_output(r, d.scheduler, VOCAB), r.request_id


# ---------------------------------------------------------------- chunking and budget


def test_long_prompt_is_chunked_across_steps_then_decodes() -> None:
    d = make_driver(max_num_batched_tokens=8)
    r = make_request("a", prompt(20), max_tokens=3)
    d.scheduler.add_request(r)
    spans = []
    while d.scheduler.has_unfinished_requests():
        sched, _ = d.step()
        (sr,) = sched.scheduled
        spans.append((sr.start_pos, sr.num_tokens, sr.sample))
    assert spans == [(0, 8, False), (8, 8, False), (16, 4, True), (20, 1, True), (21, 1, True)]
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 3
    assert_expected(d, r)
    assert_pool_idle(d.scheduler.kv)


def test_decode_is_never_starved_by_a_long_prefill() -> None:
    d = make_driver(num_blocks=64, max_num_batched_tokens=8)
    a = make_request("a", prompt(3), max_tokens=30)
    d.scheduler.add_request(a)
    d.step()
    b = make_request("b", prompt(60, base=1), max_tokens=2)
    d.scheduler.add_request(b)
    num_prefill_steps = 0
    while b.num_computed_tokens < 60:
        sched, _ = d.step()
        shares = {sr.request_id: sr.num_tokens for sr in sched.scheduled}
        assert shares["a"] == 1 and sched.scheduled[0].request_id == "a"
        assert shares["b"] == min(7, 60 - (b.num_computed_tokens - shares["b"]))
        num_prefill_steps += 1
    assert num_prefill_steps == 9  # ceil(60 / 7)
    d.run()
    assert_expected(d, a, b)
    assert_pool_idle(d.scheduler.kv)


def test_budget_and_seat_cap_hold_every_step_and_work_conserves() -> None:
    d = make_driver(num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    reqs = [make_request(f"r{i}", prompt(10 + 4 * i, base=i), max_tokens=5 + i) for i in range(6)]
    for r in reqs:
        d.scheduler.add_request(r)
    d.run()  # the Driver asserts the budget and max_num_seqs every step
    full = [o.total_num_scheduled_tokens for o in d.outputs]
    assert max(full) == 16 and full[0] == 16  # the budget is used when there is work
    assert max(len(o.scheduled) for o in d.outputs) == 4
    assert d.scheduler.stats()["max_concurrent_requests"] == 4
    assert_expected(d, *reqs)
    assert_pool_idle(d.scheduler.kv)


def test_priority_then_fifo_order() -> None:
    d = make_driver(max_num_seqs=1)
    specs = [("p1a", 1), ("p0a", 0), ("p1b", 1), ("p0b", 0), ("p0c", 0)]
    reqs = {
        rid: make_request(rid, prompt(5, base=i), max_tokens=2, priority=p)
        for i, (rid, p) in enumerate(specs)
    }
    for r in reqs.values():
        d.scheduler.add_request(r)
    d.run()
    order = sorted(reqs, key=lambda rid: reqs[rid].first_scheduled_time)
    assert order == ["p0a", "p0b", "p0c", "p1a", "p1b"]
    assert_pool_idle(d.scheduler.kv)


# ---------------------------------------------------------------- admission


def test_admission_headroom_blocks_then_admits_after_finish() -> None:
    # 16 blocks of 4; A holds 10-11 blocks; B needs 3 but would leave < 4 (25%) free.
    d = make_driver(num_blocks=16, max_num_batched_tokens=64, admission_headroom=0.25)
    a = make_request("a", prompt(40), max_tokens=4)
    b = make_request("b", prompt(12, base=1), max_tokens=2)
    d.scheduler.add_request(a)
    d.step()
    d.scheduler.add_request(b)
    d.run()
    finish_a = next(i for i, o in enumerate(d.outputs) if "a" in o.finished_req_ids)
    assert first_step_of(d, "b") == finish_a  # first step after A's blocks were freed
    assert all("b" not in scheduled_ids(d, i) for i in range(finish_a))
    assert_pool_idle(d.scheduler.kv)

    # Same workload without headroom: B joins the very next step.
    d = make_driver(num_blocks=16, max_num_batched_tokens=64, admission_headroom=0.0)
    a = make_request("a", prompt(40), max_tokens=4)
    b = make_request("b", prompt(12, base=1), max_tokens=2)
    d.scheduler.add_request(a)
    d.step()
    d.scheduler.add_request(b)
    d.run()
    assert first_step_of(d, "b") == 1
    assert_expected(d, a, b)


def test_nothing_running_admits_the_head_regardless_of_headroom() -> None:
    # Headroom 90% of the pool: only the no-deadlock rule can admit anything.
    d = make_driver(num_blocks=16, admission_headroom=0.9, resume_watermark=0.95)
    a = make_request("a", prompt(40), max_tokens=4)
    b = make_request("b", prompt(12, base=1), max_tokens=2)
    d.scheduler.add_request(a)
    d.scheduler.add_request(b)
    d.run()
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert a.finished_time is not None and b.first_scheduled_time is not None
    assert b.first_scheduled_time > a.finished_time  # one at a time
    assert_expected(d, a, b)
    assert_pool_idle(d.scheduler.kv)


def _pressure_pair(d: Driver) -> tuple[Request, Request]:
    """A and B both grow to 5 blocks in a 6-block pool: B (later) gets preempted."""
    a = make_request("a", prompt(8), max_tokens=12)
    b = make_request("b", prompt(8, base=1), max_tokens=12)
    d.scheduler.add_request(a)
    d.scheduler.add_request(b)
    return a, b


def _first_preemption(d: Driver) -> int:
    while not d.scheduler.totals.preemptions:
        d.step()
    return len(d.outputs) - 1


def _trio(d: Driver) -> tuple[Request, Request, Request]:
    """8 blocks of 4: A grows to 6 blocks, B and C to 3; C (latest) is preempted first."""
    reqs = (
        make_request("a", prompt(4), max_tokens=20),
        make_request("b", prompt(4, base=1), max_tokens=8),
        make_request("c", prompt(4, base=2), max_tokens=8),
    )
    for r in reqs:
        d.scheduler.add_request(r)
    return reqs


def _finish_step(r: Request) -> int:
    """The step in which ``r`` finished (the fake clock counts steps)."""
    assert r.finished_time is not None
    return int(r.finished_time)


def test_hysteresis_keeps_admission_closed_until_the_watermark() -> None:
    d = make_driver(num_blocks=8, resume_watermark=0.9)  # reopen at 8 free blocks
    a, b, c = _trio(d)
    k = _first_preemption(d)
    assert d.outputs[k].preempted_req_ids == {"c"} and c.status == RequestStatus.PREEMPTED
    assert d.scheduler.admission_closed
    e = make_request("e", prompt(4, base=3), max_tokens=2)
    d.scheduler.add_request(e)
    d.run()
    finish_a = _finish_step(a)
    assert _finish_step(b) < finish_a
    for i in range(k + 1, finish_a + 1):  # blocks were free after B finished, but below 8
        assert scheduled_ids(d, i) <= {"a", "b"}
    assert "c" in scheduled_ids(d, finish_a + 1)
    assert first_step_of(d, "e") > finish_a
    assert_expected(d, a, b, c, e)
    assert_pool_idle(d.scheduler.kv)


def test_admission_closed_figure_is_0_once_the_free_blocks_reach_the_watermark() -> None:
    d = make_driver(num_blocks=8, resume_watermark=0.9)
    _trio(d)
    _first_preemption(d)
    assert d.scheduler.stats()["admission_closed"] == 1  # 8 free blocks needed, fewer free
    d.run()
    # Idle, every block free: admission waits for nothing, though no step has re-checked it.
    assert d.scheduler.kv.num_free_blocks == 8
    assert d.scheduler.stats()["admission_closed"] == 0


def test_without_hysteresis_the_victim_returns_while_others_run() -> None:
    d = make_driver(num_blocks=8, resume_watermark=0.0)
    a, b, c = _trio(d)
    k = _first_preemption(d)
    assert d.outputs[k].preempted_req_ids == {"c"}
    d.run()
    returns = [i for i in range(k + 1, len(d.outputs)) if "c" in scheduled_ids(d, i)]
    assert returns[0] < _finish_step(a)
    assert_expected(d, a, b, c)
    assert_pool_idle(d.scheduler.kv)


# ---------------------------------------------------------------- preemption


def _three_growing(d: Driver, priorities: list[int]) -> list[Request]:
    reqs = [
        make_request(f"r{i}", prompt(4, base=i), max_tokens=20, priority=p, arrival_time=float(i))
        for i, p in enumerate(priorities)
    ]
    for r in reqs:
        d.scheduler.add_request(r)
    return reqs


def test_default_victim_is_lowest_priority_then_latest_arrival() -> None:
    d = make_driver(num_blocks=6)
    reqs = _three_growing(d, [0, 2, 1])
    k = _first_preemption(d)
    assert d.outputs[k].preempted_req_ids == {"r1"}  # priority 2
    d.run()
    assert_expected(d, *reqs)

    d = make_driver(num_blocks=6)
    reqs = _three_growing(d, [1, 1, 1])
    k = _first_preemption(d)
    assert d.outputs[k].preempted_req_ids == {"r2"}  # latest arrival
    d.run()
    assert_expected(d, *reqs)
    assert_pool_idle(d.scheduler.kv)


class EarliestArrivalFirstOut(PreemptionPolicy):
    """Serves the newest first and preempts the oldest (the opposite of the default)."""

    def sort_key(self, request: Request) -> SortKey:
        return (-request.arrival_time,)


def test_custom_policy_chooses_the_victim() -> None:
    d = make_driver(num_blocks=6, policy=EarliestArrivalFirstOut())
    reqs = _three_growing(d, [1, 1, 1])
    k = _first_preemption(d)
    assert d.outputs[k].preempted_req_ids == {"r0"}
    d.run()
    assert_expected(d, *reqs)
    assert_pool_idle(d.scheduler.kv)


def test_recompute_counts_wasted_tokens_and_keeps_outputs() -> None:
    d = make_driver(num_blocks=6)
    a, b = _pressure_pair(d)
    k = _first_preemption(d)
    wasted = d.scheduler.totals.recomputed_tokens_wasted
    assert wasted == b.num_prompt_tokens + b.num_output_tokens - 1  # all it had computed
    assert b.num_output_tokens > 0 and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert d.outputs[k].blocks_to_swap_out == []
    d.run()
    assert_expected(d, a, b)
    st = d.scheduler.stats()
    assert st["preemptions"] == st["preemptions_recompute"] >= 1
    assert st["preemptions_per_1k_scheduled"] == pytest.approx(
        1000 * st["preemptions"] / st["num_scheduled_requests"]
    )
    # the prefix figures count each request's tokens once: a re-admission looks them up
    # again, which is recompute, not prompt reuse
    queries = d.scheduler.kv.counters.prefix_cache_queries
    assert queries == a.num_prompt_tokens + b.num_prompt_tokens
    assert_pool_idle(d.scheduler.kv)


def test_recompute_waste_leaves_out_prefix_hit_tokens() -> None:
    d = make_driver(num_blocks=6)
    p = make_request("p", prompt(8, base=1), max_tokens=1)
    d.scheduler.add_request(p)
    d.run()  # p's two prompt blocks stay in the prefix cache
    a = make_request("a", prompt(8), max_tokens=12)
    b = make_request("b", prompt(8, base=1) + prompt(4, base=5), max_tokens=12)
    d.scheduler.add_request(a)
    d.scheduler.add_request(b)
    sched, _ = d.step()
    # b hit p's blocks 0 and 1 (8 tokens, no compute) and computed its last 4 prompt tokens.
    assert [(sr.request_id, sr.start_pos, sr.block_ids) for sr in sched.scheduled] == [
        ("a", 0, [2, 3]),
        ("b", 8, [0, 1, 4]),
    ]
    assert (b.num_cached_tokens, b.num_reused_tokens) == (8, 8)
    sched, _ = d.step()
    assert sched.preempted_req_ids == {"b"}  # b's 13th token needs a fourth block
    # 12 tokens were computed for b, 4 of them by b: only those are wasted.
    assert d.scheduler.totals.recomputed_tokens_wasted == 4
    assert d.scheduler.last_step.num_recomputed_tokens == 4
    assert (b.num_computed_tokens, b.num_reused_tokens) == (0, 0)
    d.run()
    assert d.scheduler.totals.preemptions == 1
    assert d.scheduler.totals.recomputed_tokens_wasted == 4
    assert_expected(d, p, a, b)
    assert_pool_idle(d.scheduler.kv)


def test_recompute_waste_of_a_forked_sample_leaves_out_its_shared_prompt() -> None:
    d = make_driver(num_blocks=6)
    f = make_request("f", prompt(8), max_tokens=12, n=2)
    child = f.pending_children[0]
    d.scheduler.add_request(f)
    wasted_at: dict[int, int] = {}
    d.on_step = lambda sched, _touched: wasted_at.update(
        {len(d.outputs) - 1: d.scheduler.last_step.num_recomputed_tokens}
    )
    k = _first_preemption(d)
    # The fork shared the parent's first 7 prompt tokens; the child then computed 8 (its
    # copy of the 8th and 7 of its own): 8 wasted, not 15.
    assert (k, d.outputs[k].preempted_req_ids) == (9, {"f#1"})
    assert d.scheduler.totals.recomputed_tokens_wasted == wasted_at[9] == 8
    d.run()
    # Re-admitted with a 12-token prefix hit, it computed 4 before its second preemption.
    assert d.scheduler.totals.preemptions == 2
    assert [n for n in wasted_at.values() if n] == [8, 4]
    assert d.scheduler.totals.recomputed_tokens_wasted == 12
    assert_expected(d, f, child)
    assert_pool_idle(d.scheduler.kv)


def test_swap_round_trip_swaps_in_before_new_admissions() -> None:
    d = make_driver(num_blocks=6, num_host_blocks=12, preemption_mode="swap")
    a, b = _pressure_pair(d)
    k = _first_preemption(d)
    assert b.status == RequestStatus.SWAPPED
    assert len(d.outputs[k].blocks_to_swap_out) == d.scheduler.kv.num_swapped_blocks(b) == 3
    c = make_request("c", prompt(4, base=2), max_tokens=2)
    d.scheduler.add_request(c)
    d.run()
    swap_in_step = next(i for i, o in enumerate(d.outputs) if o.blocks_to_swap_in)
    assert "b" in scheduled_ids(d, swap_in_step)  # swapped in and continued at once
    assert first_step_of(d, "c") >= swap_in_step
    assert d.scheduler.totals.preemptions_swap >= 1
    assert d.scheduler.totals.recomputed_tokens_wasted == 0
    assert_expected(d, a, b, c)
    assert_pool_idle(d.scheduler.kv)


def test_swap_falls_back_to_recompute_when_the_host_tier_is_full() -> None:
    d = make_driver(num_blocks=6, num_host_blocks=1, preemption_mode="swap")
    a, b = _pressure_pair(d)
    k = _first_preemption(d)
    assert b.status == RequestStatus.PREEMPTED and d.outputs[k].blocks_to_swap_out == []
    assert d.scheduler.totals.swap_fallbacks_to_recompute == 1
    d.run()
    assert_expected(d, a, b)
    assert_pool_idle(d.scheduler.kv)


# ---------------------------------------------------------------- limits and rejection


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "n", "limit"),
    [
        (0, 4, 1, "empty prompt"),
        (30, 40, 1, "max_model_len=64"),
        (64, None, 1, "max_model_len=64"),
        (30, 20, 1, "num_kv_blocks=8"),
        (33, None, 1, "num_kv_blocks=8"),
        # a prompt that fills the pool leaves no room for its first token (nor for the copy
        # an n > 1 child or a cached last block is recomputed into)
        (32, None, 1, "9 KV blocks at once for 33 tokens"),
        (32, None, 2, "9 KV blocks at once for 33 tokens"),
        (4, 4, 9, "max_num_seqs=8"),
    ],
)
def test_never_fit_requests_are_rejected(
    prompt_len: int, max_tokens: int | None, n: int, limit: str
) -> None:
    d = make_driver(num_blocks=8, max_model_len=64)
    r = make_request("x", prompt(prompt_len), max_tokens=max_tokens, n=n)
    with pytest.raises(ValueError, match=limit):
        d.scheduler.add_request(r)
    assert not d.scheduler.has_unfinished_requests() and d.scheduler.num_waiting == 0


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_prompt_one_token_short_of_the_pool_runs_to_its_end(n: int) -> None:
    d = make_driver(num_blocks=8, max_model_len=64)
    d.scheduler.add_request(make_request("x", prompt(31), max_tokens=None, n=n))
    d.run()
    assert not d.scheduler.has_unfinished_requests()
    assert_pool_idle(d.scheduler.kv)


def test_duplicate_id_and_unchunkable_prompt_are_rejected() -> None:
    d = make_driver(max_num_batched_tokens=8, enable_chunked_prefill=False)
    d.scheduler.add_request(make_request("x", prompt(4)))
    with pytest.raises(ValueError, match="already in use"):
        d.scheduler.add_request(make_request("x", prompt(4)))
    with pytest.raises(ValueError, match="max_num_batched_tokens=8"):
        d.scheduler.add_request(make_request("y", prompt(9)))
    used = make_request("z", prompt(4))
    used.num_computed_tokens = 2
    with pytest.raises(ValueError, match="must be new"):
        d.scheduler.add_request(used)
    odd = make_request("p", prompt(4), n=2)
    odd.pending_children[0].prompt_token_ids = prompt(5)
    with pytest.raises(ValueError, match="must share parent 'p'"):
        d.scheduler.add_request(odd)
    assert d.scheduler.num_waiting == 1 and d.scheduler.get_request("p#1") is None


def test_without_chunked_prefill_prompts_wait_for_a_whole_budget() -> None:
    d = make_driver(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a = make_request("a", prompt(6), max_tokens=3)
    b = make_request("b", prompt(6, base=1), max_tokens=3)
    d.scheduler.add_request(a)
    d.scheduler.add_request(b)
    d.run()
    spans = [[(sr.request_id, sr.num_tokens) for sr in o.scheduled] for o in d.outputs]
    assert spans[:3] == [[("a", 6)], [("a", 1), ("b", 6)], [("a", 1), ("b", 1)]]
    assert_expected(d, a, b)
    assert_pool_idle(d.scheduler.kv)


def test_unbounded_request_finishes_with_length_when_it_fills_the_pool() -> None:
    # 4 blocks x 4 = 16 token slots: the 16th token's KV fits, a 17th token's cannot.
    d = make_driver(num_blocks=4, max_model_len=256)
    a = make_request("a", prompt(5), max_tokens=None)
    d.scheduler.add_request(a)
    d.run()
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_tokens == 17
    assert_expected(d, a)
    # Two of them compete for the pool: preemptions, but both still finish the same way.
    d = make_driver(num_blocks=4, max_model_len=256)
    reqs = [make_request(f"u{i}", prompt(5, base=i), max_tokens=None) for i in range(2)]
    for r in reqs:
        d.scheduler.add_request(r)
    d.run()
    assert d.scheduler.totals.preemptions > 0
    assert all(r.num_tokens == 17 for r in reqs)
    assert_expected(d, *reqs)
    assert_pool_idle(d.scheduler.kv)


def test_unbounded_request_stops_at_max_model_len() -> None:
    d = make_driver(num_blocks=16, max_model_len=10)
    a = make_request("a", prompt(5), max_tokens=None)
    d.scheduler.add_request(a)
    d.run()
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_tokens == 10


# ---------------------------------------------------------------- stop checks (hand-built outputs)


def _step_with(d: Driver, token_id: int) -> list[Request]:
    sched = d.scheduler.schedule()
    sampled = {sr.request_id: token_id for sr in sched.scheduled if sr.sample}
    return d.scheduler.update_from_output(sched, runner_output(sampled))


def test_eos_counts_only_after_min_tokens() -> None:
    d = make_driver()
    r = make_request("r", prompt(4), max_tokens=10, eos_token_id=5, min_tokens=2)
    d.scheduler.add_request(r)
    assert _step_with(d, 5) == [r] and r.status == RequestStatus.RUNNING
    assert _step_with(d, 5) == [r] and r.status == RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [5, 5] and r.stop_reason is None and r.finish_reason == "stop"
    assert_pool_idle(d.scheduler.kv)


def test_ignore_eos_and_stop_token_ids() -> None:
    d = make_driver()
    r = make_request("r", prompt(4), max_tokens=3, eos_token_id=5, ignore_eos=True)
    s = make_request("s", prompt(4, base=1), max_tokens=9, stop_token_ids=[7, 9])
    d.scheduler.add_request(r)
    d.scheduler.add_request(s)
    _step_with(d, 5)
    _step_with(d, 5)
    assert r.status == RequestStatus.RUNNING and s.status == RequestStatus.RUNNING
    _step_with(d, 9)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [5, 5, 9]
    assert s.status == RequestStatus.FINISHED_STOPPED and s.stop_reason == 9
    assert_pool_idle(d.scheduler.kv)


def test_token_for_a_request_aborted_after_schedule_is_ignored() -> None:
    d = make_driver()
    r = make_request("r", prompt(4), max_tokens=4)
    d.scheduler.add_request(r)
    sched = d.scheduler.schedule()
    d.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert d.scheduler.update_from_output(sched, runner_output({"r": 3})) == []
    assert r.output_token_ids == [] and r.status == RequestStatus.FINISHED_ABORTED
    assert "r" in d.scheduler.schedule().finished_req_ids
    assert_pool_idle(d.scheduler.kv)


def test_missing_sampled_token_is_an_error() -> None:
    d = make_driver()
    d.scheduler.add_request(make_request("r", prompt(4)))
    sched = d.scheduler.schedule()
    with pytest.raises(ValueError, match="sampled token of 'r'"):
        d.scheduler.update_from_output(sched, runner_output({}))


# ---------------------------------------------------------------- abort in every state


def test_abort_waiting_running_and_preempted_requests() -> None:
    d = make_driver(num_blocks=6)
    a, b = _pressure_pair(d)
    w = make_request("w", prompt(4, base=3), max_tokens=3, priority=5)
    d.scheduler.add_request(w)
    _first_preemption(d)
    assert b.status == RequestStatus.PREEMPTED and w.status == RequestStatus.WAITING
    d.scheduler.finish_requests(["b", "w"], RequestStatus.FINISHED_ABORTED)
    assert b.status == w.status == RequestStatus.FINISHED_ABORTED
    assert d.scheduler.num_waiting == 0 and d.scheduler.get_request("b") is None
    d.step()
    d.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # running
    assert a.status == RequestStatus.FINISHED_ABORTED and a.finished_time is not None
    assert d.scheduler.num_running == 0 and not d.scheduler.has_unfinished_requests()
    d.scheduler.finish_requests(["a", "nope"], RequestStatus.FINISHED_ABORTED)  # idempotent
    assert d.scheduler.totals.num_aborted_requests == 3
    assert_pool_idle(d.scheduler.kv)
    with pytest.raises(ValueError, match="FINISHED_"):
        d.scheduler.finish_requests("a", RequestStatus.RUNNING)


def test_abort_swapped_request_frees_host_blocks() -> None:
    d = make_driver(num_blocks=6, num_host_blocks=12, preemption_mode="swap")
    a, b = _pressure_pair(d)
    _first_preemption(d)
    assert b.status == RequestStatus.SWAPPED and d.scheduler.num_swapped == 1
    d.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert d.scheduler.num_swapped == 0
    assert d.scheduler.kv.num_free_host_blocks == 12
    d.run()
    assert_expected(d, a)
    assert_pool_idle(d.scheduler.kv)


def test_abort_pending_child_and_parent_before_fork() -> None:
    d = make_driver(max_num_batched_tokens=4)
    p = make_request("p", prompt(10), max_tokens=3, n=3, seed=1)
    q = make_request("q", prompt(10, base=1), max_tokens=3, n=2, seed=1)
    d.scheduler.add_request(p)
    d.scheduler.add_request(q)
    d.step()  # p's prompt is still being computed: children pending
    child1, child2 = p.pending_children
    d.scheduler.finish_requests("p#1", RequestStatus.FINISHED_ABORTED)
    assert child1.status == RequestStatus.FINISHED_ABORTED and p.pending_children == [child2]
    (qchild,) = q.pending_children
    d.scheduler.finish_requests("q", RequestStatus.FINISHED_ABORTED)  # waiting parent
    assert qchild.status == RequestStatus.FINISHED_ABORTED
    assert d.scheduler.get_request("q#1") is None
    d.run()
    assert p.status == child2.status == RequestStatus.FINISHED_LENGTH
    assert all(o.scheduled and "p#1" not in scheduled_ids(d, i) for i, o in enumerate(d.outputs))
    assert_expected(d, p, child2)
    assert_pool_idle(d.scheduler.kv)


# ---------------------------------------------------------------- n > 1


def test_fork_after_prompt_emits_copy_on_write_and_samples_differ() -> None:
    d = make_driver(max_num_seqs=3, max_seats_per_request=3)
    p = make_request("p", prompt(6), max_tokens=6, n=3, seed=7)
    x = make_request("x", prompt(4, base=1), max_tokens=2)
    d.scheduler.add_request(p)
    d.scheduler.add_request(x)
    sched, _ = d.step()
    assert [sr.request_id for sr in sched.scheduled] == ["p"]  # 3 seats taken by p's samples
    c1, c2 = (d.scheduler.get_request(f"p#{i}") for i in (1, 2))
    assert c1 is not None and c2 is not None and not p.pending_children
    assert c1.status == c2.status == RequestStatus.RUNNING and c1.num_computed_tokens == 5
    sched, _ = d.step()
    by_id = {sr.request_id: sr for sr in sched.scheduled}
    assert by_id["p#1"].start_pos == 5 and by_id["p#1"].token_ids == [p.prompt_token_ids[5]]
    assert by_id["p#1"].seed == 8 and by_id["p#2"].seed == 9 and by_id["p"].seed == 7
    # Everyone writes into the shared partial prompt block: copies of it are emitted, and
    # the three tables no longer share a block they write to.
    shared = d.outputs[0].scheduled[0].block_ids[1]
    assert len(sched.blocks_to_copy) >= 2 and {s for s, _ in sched.blocks_to_copy} == {shared}
    assert len({by_id[rid].block_ids[1] for rid in ("p", "p#1", "p#2")}) == 3
    d.run()
    assert_expected(d, p, c1, c2)
    assert len({tuple(r.output_token_ids) for r in (p, c1, c2)}) > 1
    assert first_step_of(d, "x") > 1
    assert d.scheduler.kv.snapshot()["cow_copies"] >= 2
    assert_pool_idle(d.scheduler.kv)


def test_a_request_that_recomputed_a_cached_block_caches_its_later_blocks() -> None:
    """b is admitted while a still prefills the same prompt: b hits a's first blocks and
    computes the last one again (a duplicate). Its own conversation after that must still
    land in the prefix cache, on a's path (the duplicate swapped for a's block)."""
    d = make_driver(num_blocks=64, max_num_batched_tokens=16)
    p = prompt(20)  # 5 full blocks of 4
    a = make_request("a", p, max_tokens=12, seed=1)
    b = make_request("b", p, max_tokens=12, seed=2)  # seeded: b's tokens differ from a's
    d.scheduler.add_request(a)
    d.scheduler.add_request(b)
    d.run()
    assert_expected(d, a, b)
    assert a.output_token_ids[:8] != b.output_token_ids[:8]
    kv = d.scheduler.kv
    assert kv.snapshot()["dedup_blocks"] == 1
    follow_up = make_request("c", p + b.output_token_ids[:8] + [1])
    assert kv.get_computed_blocks(follow_up)[1] == 28  # before: 20, a's prompt path only
    assert_pool_idle(kv)


def test_parent_preempted_before_fork_keeps_children_pending() -> None:
    # A fills 6 of 8 blocks; P's prompt takes the last 2 in chunks, then A needs one more.
    d = make_driver(num_blocks=8, max_num_batched_tokens=4)
    a = make_request("a", prompt(22), max_tokens=10, priority=0)
    d.scheduler.add_request(a)
    while not a.output_token_ids:
        d.step()
    p = make_request("p", prompt(8, base=1), max_tokens=4, n=2, priority=1)
    (child,) = p.pending_children
    d.scheduler.add_request(p)
    k = _first_preemption(d)
    assert d.outputs[k].preempted_req_ids == {"p"} and p.status == RequestStatus.PREEMPTED
    assert p.pending_children == [child] and child.status == RequestStatus.WAITING
    d.run()
    assert child.status == RequestStatus.FINISHED_LENGTH
    assert_expected(d, a, p, child)
    assert_pool_idle(d.scheduler.kv)


# ---------------------------------------------------------------- metrics


def test_stats_and_timestamps() -> None:
    d = make_driver(num_blocks=6)
    a, b = _pressure_pair(d)
    d.run()
    st = d.scheduler.stats()
    for name in (
        "num_kv_blocks",
        "kv_usage",
        "preemptions",
        "preemptions_per_1k_scheduled",
        "recomputed_tokens_wasted",
        "max_concurrent_requests",
        "num_running",
        "num_waiting",
        "num_swapped",
        "schedule_time_s",
        "num_steps",
    ):
        assert name in st, name
    assert st["num_steps"] == len(d.outputs) and st["max_concurrent_requests"] == 2
    assert st["num_running"] == st["num_waiting"] == st["num_swapped"] == 0
    assert st["preemptions"] > 0 and st["kv_usage"] == 0.0
    last = d.scheduler.last_step
    assert last.step == len(d.outputs) - 1 and last.schedule_time_s >= 0
    for r in (a, b):
        assert r.first_scheduled_time == 0.0  # both admitted in the first step (clock = step)
        assert r.first_token_time is not None and r.last_token_time is not None
        assert r.first_token_time <= r.last_token_time == r.finished_time


class ChoosesAScheduledVictim(PreemptionPolicy):
    """A broken policy: names a request that is not among the candidates."""

    def sort_key(self, request: Request) -> SortKey:
        return (request.arrival_time,)

    def select_victim(self, candidates: Sequence[Request]) -> Request:
        return Request("ghost", [1], candidates[0].sampling_params)


def test_policy_choosing_outside_the_candidates_is_an_error() -> None:
    d = make_driver(num_blocks=6, policy=ChoosesAScheduledVictim())
    _pressure_pair(d)
    with pytest.raises(ValueError, match="'ghost', not one of the candidates"):
        d.run()
