"""Fair seats (a request's samples beyond its share wait), priority preemption, and the
prefix cache forgetting the blocks of a request whose step failed."""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.outputs import ModelRunnerOutput
from kvserve.request import RequestStatus
from tests.core.fake_runner import assert_pool_idle, make_request
from tests.core.sched_helpers import assert_expected, first_step_of, make_driver, prompt


def test_seat_share_defaults_to_half_and_is_capped() -> None:
    assert SchedulerConfig(max_num_seqs=64).seat_share == 32
    assert SchedulerConfig(max_num_seqs=1).seat_share == 1
    assert SchedulerConfig(max_num_seqs=4, max_seats_per_request=9).seat_share == 4
    with pytest.raises(ValueError, match="max_seats_per_request"):
        SchedulerConfig(max_seats_per_request=0)
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")  # type: ignore[arg-type]
    # Seats are capped at the token budget, and the share with them.
    capped = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8)
    assert (capped.max_running, capped.seat_share) == (8, 4)
    assert SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64).max_running == 8


def test_seats_beyond_the_token_budget_are_not_filled() -> None:
    """With max_num_seqs above max_num_batched_tokens, n > 1 forks filled every seat and the
    requests past the budget held their blocks for a dozen steps without a token."""
    d = make_driver(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=4)
    reqs = [make_request(f"r{i}", prompt(6, base=i), max_tokens=12, n=4) for i in range(4)]
    for r in reqs:
        d.scheduler.add_request(r)
    samples = [c for r in reqs for c in r.pending_children]
    d.run()  # the driver checks num_running <= max_running (4) every step
    last: dict[str, int] = {}
    for step, out in enumerate(d.outputs):
        for sr in out.scheduled:
            # A running request is served every step once in (decodes come before prefills).
            assert step - last.get(sr.request_id, step - 1) == 1, sr.request_id
            last[sr.request_id] = step
    assert [len(s.output_token_ids) for s in (*reqs, *samples)] == [12] * 16
    assert_expected(d, *reqs, *samples)
    assert_pool_idle(d.scheduler.kv)


def test_samples_beyond_the_share_wait_behind_earlier_requests() -> None:
    d = make_driver(num_blocks=64, max_num_seqs=4)  # share: 2 seats
    # NOTE: arrivals before the fake clock's 0.0, when the extra samples are deferred.
    p = make_request("p", prompt(5), max_tokens=4, n=4, arrival_time=-4.0)
    others = [
        make_request(f"x{i}", prompt(5, base=i + 1), max_tokens=6, arrival_time=i - 3.0)
        for i in range(3)
    ]
    for r in (p, *others):
        d.scheduler.add_request(r)
    sched, _ = d.step()
    # p reserves 2 seats (itself and one sample), so x0 and x1 get the other two at once.
    assert [sr.request_id for sr in sched.scheduled] == ["p", "x0", "x1"]
    children = [d.scheduler.get_request(f"p#{i}") for i in (1, 2, 3)]
    assert all(c is not None for c in children)
    assert [c.status for c in children] == [  # type: ignore[union-attr]
        RequestStatus.RUNNING,
        RequestStatus.WAITING,
        RequestStatus.WAITING,
    ]
    d.run()
    # The deferred samples queued behind x2, which arrived before they were deferred.
    assert first_step_of(d, "x2") < first_step_of(d, "p#2") <= first_step_of(d, "p#3")
    assert_expected(d, p, *children, *others)  # type: ignore[arg-type]
    assert_pool_idle(d.scheduler.kv)


def test_samples_fork_together_when_nobody_waits() -> None:
    d = make_driver(num_blocks=64, max_num_seqs=4)
    p = make_request("p", prompt(5), max_tokens=3, n=4)
    d.scheduler.add_request(p)
    d.step()
    sched, _ = d.step()
    assert sorted(sr.request_id for sr in sched.scheduled) == ["p", "p#1", "p#2", "p#3"]
    d.run()
    assert_pool_idle(d.scheduler.kv)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_policy_preempts_less_important_running_requests(policy: str) -> None:
    d = make_driver(num_blocks=64, max_num_seqs=2, scheduling_policy=policy)
    low = [
        make_request(f"low{i}", prompt(4, base=i), max_tokens=30, priority=1, arrival_time=i)
        for i in (0, 1)
    ]
    for r in low:
        d.scheduler.add_request(r)
    d.step()
    d.step()
    urgent = make_request("urgent", prompt(4, base=5), max_tokens=3, priority=0)
    d.scheduler.add_request(urgent)
    start = len(d.outputs)
    d.run()
    waited = first_step_of(d, "urgent") - start
    if policy == "priority":
        # One step preempts the latest low-priority request, the next admits the urgent one.
        assert waited <= 1
        assert low[1].num_preemptions == 1 and low[0].num_preemptions == 0
        assert d.scheduler.totals.priority_preemptions == 1
    else:
        assert waited >= 20  # it waits for a seat: nobody is preempted for priority
        assert d.scheduler.totals.preemptions == 0
    assert_expected(d, urgent, *low)
    assert_pool_idle(d.scheduler.kv)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_admits_an_important_request_while_less_important_ones_are_swapped(
    policy: str,
) -> None:
    d = make_driver(
        num_blocks=12, num_host_blocks=64, preemption_mode="swap", scheduling_policy=policy
    )
    mid = make_request("mid", prompt(8), max_tokens=30, priority=1, arrival_time=0.0)
    low = make_request("low", prompt(8, base=1), max_tokens=30, priority=2, arrival_time=1.0)
    d.scheduler.add_request(mid)
    d.scheduler.add_request(low)
    while low.status != RequestStatus.SWAPPED:
        d.step()
    urgent = make_request("urgent", prompt(4, base=2), max_tokens=2, priority=0)
    d.scheduler.add_request(urgent)
    start = len(d.outputs)
    d.run()
    waited = first_step_of(d, "urgent") - start
    if policy == "priority":
        assert waited == 0  # it fits: admitted at once, low stays on the host tier
    else:
        assert waited > 5  # behind the swapped-out request, as fcfs orders them
    assert_expected(d, mid, low, urgent)
    assert_pool_idle(d.scheduler.kv)


@pytest.mark.parametrize("forget", [True, False])
def test_failed_step_leaves_no_unwritten_block_in_the_prefix_cache(forget: bool) -> None:
    d = make_driver(num_blocks=32)
    a = make_request("a", prompt(12), max_tokens=4)
    d.scheduler.add_request(a)
    s = d.scheduler
    sched = s.schedule()  # a's 3 full prompt blocks enter the prefix cache now
    assert [sr.request_id for sr in sched.scheduled] == ["a"]
    # The step fails for a: its KV is never written.
    if forget:
        assert s.kv.forget_unwritten(a, sched.scheduled[0].start_pos) == 3
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    s.update_from_output(sched, ModelRunnerOutput())
    s.kv.check_integrity()
    b = make_request("b", prompt(12), max_tokens=4)  # the same prompt
    s.add_request(b)
    if forget:
        d.run()
        assert_expected(d, b)
        assert_pool_idle(s.kv)
    else:  # the FakeRunner finds b reading a's never-written KV
        with pytest.raises(AssertionError, match="cached prefix wrong"):
            d.run()
