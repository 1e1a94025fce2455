"""Scheduler request life: stop checks on hand-built runner outputs, abort in every state,
n > 1 (fork after the prompt, pending children)."""

from __future__ import annotations

import pytest

from kvserve.request import Request, RequestStatus
from tests.core.fake_runner import (
    Driver,
    assert_pool_idle,
    make_request,
    runner_output,
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
    a, b = pressure_pair(d)
    w = make_request("w", prompt(4, base=3), max_tokens=3, priority=5)
    d.scheduler.add_request(w)
    first_preemption(d)
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
    a, b = pressure_pair(d)
    first_preemption(d)
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
    # NOTE: greedy chunks (no fair share): a's first 16 tokens are cached before b's turn.
    d = make_driver(num_blocks=64, max_num_batched_tokens=16, prefill_share=1.0)
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
    k = first_preemption(d)
    assert d.outputs[k].preempted_req_ids == {"p"} and p.status == RequestStatus.PREEMPTED
    assert p.pending_children == [child] and child.status == RequestStatus.WAITING
    d.run()
    assert child.status == RequestStatus.FINISHED_LENGTH
    assert_expected(d, a, p, child)
    assert_pool_idle(d.scheduler.kv)
