"""Scheduler unit tests: chunking and the token budget, limits and rejection, figures
(a FakeRunner simulating the paged cache; see sched_helpers.py)."""

from __future__ import annotations

import pytest

from kvserve.request import RequestStatus
from tests.core.fake_runner import (
    assert_pool_idle,
    make_request,
)
from tests.core.sched_helpers import (
    assert_expected,
    make_driver,
    pressure_pair,
    prompt,
)

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


# ---------------------------------------------------------------- metrics


def test_stats_and_timestamps() -> None:
    d = make_driver(num_blocks=6)
    a, b = pressure_pair(d)
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
