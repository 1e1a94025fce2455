"""Scheduler admission: the headroom, the nothing-running rule, hysteresis up to the resume
watermark (a FakeRunner simulating the paged cache)."""

from __future__ import annotations

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
    prompt,
    scheduled_ids,
)

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
    k = first_preemption(d)
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
    first_preemption(d)
    assert d.scheduler.stats()["admission_closed"] == 1  # 8 free blocks needed, fewer free
    d.run()
    # Idle, every block free: admission waits for nothing, though no step has re-checked it.
    assert d.scheduler.kv.num_free_blocks == 8
    assert d.scheduler.stats()["admission_closed"] == 0


def test_without_hysteresis_the_victim_returns_while_others_run() -> None:
    d = make_driver(num_blocks=8, resume_watermark=0.0)
    a, b, c = _trio(d)
    k = first_preemption(d)
    assert d.outputs[k].preempted_req_ids == {"c"}
    d.run()
    returns = [i for i in range(k + 1, len(d.outputs)) if "c" in scheduled_ids(d, i)]
    assert returns[0] < _finish_step(a)
    assert_expected(d, a, b, c)
    assert_pool_idle(d.scheduler.kv)
