"""Scheduler preemption: the victim (default and custom policies), recompute and its wasted
tokens, swap and its fallback (a FakeRunner simulating the paged cache)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvserve.core.sched.policy import PreemptionPolicy, SortKey
from kvserve.request import Request, RequestStatus
from tests.core.fake_runner import (
    Driver,
    assert_pool_idle,
    make_request,
)
from tests.core.sched_helpers import (
    assert_expected,
    first_preemption,
    first_step_of,
    make_driver,
    pressure_pair,
    prompt,
    scheduled_ids,
)

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
    k = first_preemption(d)
    assert d.outputs[k].preempted_req_ids == {"r1"}  # priority 2
    d.run()
    assert_expected(d, *reqs)

    d = make_driver(num_blocks=6)
    reqs = _three_growing(d, [1, 1, 1])
    k = first_preemption(d)
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
    k = first_preemption(d)
    assert d.outputs[k].preempted_req_ids == {"r0"}
    d.run()
    assert_expected(d, *reqs)
    assert_pool_idle(d.scheduler.kv)


def test_recompute_counts_wasted_tokens_and_keeps_outputs() -> None:
    d = make_driver(num_blocks=6)
    a, b = pressure_pair(d)
    k = first_preemption(d)
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
    k = first_preemption(d)
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
    a, b = pressure_pair(d)
    k = first_preemption(d)
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
    a, b = pressure_pair(d)
    k = first_preemption(d)
    assert b.status == RequestStatus.PREEMPTED and d.outputs[k].blocks_to_swap_out == []
    assert d.scheduler.totals.swap_fallbacks_to_recompute == 1
    d.run()
    assert_expected(d, a, b)
    assert_pool_idle(d.scheduler.kv)


class ChoosesAScheduledVictim(PreemptionPolicy):
    """A broken policy: names a request that is not among the candidates."""

    def sort_key(self, request: Request) -> SortKey:
        return (request.arrival_time,)

    def select_victim(self, candidates: Sequence[Request]) -> Request:
        return Request("ghost", [1], candidates[0].sampling_params)


def test_policy_choosing_outside_the_candidates_is_an_error() -> None:
    d = make_driver(num_blocks=6, policy=ChoosesAScheduledVictim())
    pressure_pair(d)
    with pytest.raises(ValueError, match="'ghost', not one of the candidates"):
        d.run()
