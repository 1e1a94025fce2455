"""Windowed KV eviction with attention sinks: which blocks leave, and when."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.kv.window import (
    NULL_BLOCK_ID,
    KVWindow,
    WindowedKVCacheManager,
    kv_utilization_windowed,
    out_of_window_blocks,
)
from kvserve.core.sched.scheduler import Scheduler
from kvserve.request import RequestStatus
from tests.core.fake_runner import make_request, runner_output
from tests.examples import examples


def _dead_by_brute_force(num_computed: int, sinks: int, window: int, bs: int) -> list[int]:
    """Blocks none of whose positions a query at p >= num_computed can see."""
    dead = []
    for i in range(num_computed // bs + 2):
        visible = any(
            k < sinks or k > p - window
            for k in range(i * bs, (i + 1) * bs)
            for p in range(num_computed, num_computed + 3 * window + bs)
            if k <= p
        )
        if not visible:
            dead.append(i)
    return dead


@pytest.mark.parametrize("bs", [1, 4, 5])
@pytest.mark.parametrize(("window", "sinks"), [(1, 0), (4, 0), (6, 2), (8, 4), (3, 9)])
def test_out_of_window_blocks_matches_brute_force(bs: int, window: int, sinks: int) -> None:
    for num_computed in range(0, 40):
        got = list(out_of_window_blocks(num_computed, sinks, window, bs))
        assert got == _dead_by_brute_force(num_computed, sinks, window, bs), num_computed
        # Sink blocks never leave.
        assert all(i * bs >= sinks for i in got)


def test_rejects_bad_window_and_prefix_caching() -> None:
    with pytest.raises(ValueError, match="kv_window"):
        KVWindow(0)
    with pytest.raises(ValueError, match="kv_sink_tokens"):
        KVWindow(4, -1)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        WindowedKVCacheManager(8, 4, kv_window=KVWindow(4), enable_prefix_caching=True)


def test_blocks_leave_exactly_when_they_fall_out_and_sinks_stay() -> None:
    bs, window, sinks = 4, 6, 2
    kv = WindowedKVCacheManager(16, bs, kv_window=KVWindow(window, sinks))
    req = make_request("r", list(range(1, 41)), max_tokens=4)
    freed_at: dict[int, int] = {}
    for num_computed in range(0, 40):  # one token per step
        assert kv.allocate_slots(req, 1) is not None
        table_before = kv.get_block_ids("r")
        freed = kv.free_out_of_window(req)
        for block_id in freed:
            freed_at[table_before.index(block_id)] = num_computed
        kv.check_integrity()
        req.num_computed_tokens += 1
        table = kv.get_block_ids("r")
        assert table[0] != NULL_BLOCK_ID  # the sink block never leaves
        num_live = sum(b != NULL_BLOCK_ID for b in table)
        assert num_live <= 1 + -(-window // bs) + 1
        assert kv.num_free_blocks == 16 - num_live
    # Block i (positions 4i..4i+3, all >= the 2 sinks for i >= 1) leaves at the first step
    # whose queries start at a position p with p - window >= 4i + 3.
    assert freed_at == {i: 4 * i + 3 + window for i in range(1, 8)}
    kv.free(req)
    assert kv.num_free_blocks == 16
    kv.check_integrity()


def test_swap_out_refused_and_fork_shares_placeholders() -> None:
    kv = WindowedKVCacheManager(16, 2, kv_window=KVWindow(2, 0), num_host_blocks=8)
    parent = make_request("p", list(range(1, 10)), max_tokens=4, n=2)
    child = parent.pending_children[0]
    assert kv.allocate_slots(parent, 9) is not None
    parent.num_computed_tokens = 8  # freeing runs before the step that computes token 8
    freed = kv.free_out_of_window(parent)
    table = kv.get_block_ids("p")
    assert len(freed) == 3 and table[:3] == [NULL_BLOCK_ID] * 3 and NULL_BLOCK_ID not in table[3:]
    parent.num_computed_tokens = 9
    kv.fork(parent, child)
    child.num_computed_tokens = 8
    assert kv.get_block_ids("p#1") == kv.get_block_ids("p")
    kv.check_integrity()
    assert kv.swap_out(parent) is None
    snap = kv.snapshot()
    assert snap["window_freed_blocks"] == 3
    # live blocks 3, 4: the parent fills 2 + 1 tokens of them (the child no more).
    assert snap["kv_utilization"] == pytest.approx(3 / 4)
    kv.free(child)
    kv.free(parent)
    assert kv.num_free_blocks == 16
    kv.check_integrity()


def test_utilization_ignores_freed_entries() -> None:
    assert kv_utilization_windowed(iter([([NULL_BLOCK_ID, 3, 5], 10)]), 4) == pytest.approx(6 / 8)


def _run(
    kv: KVCacheManager,
    prompts: dict[str, int],
    max_tokens: int | None,
    *,
    chunk: int = 8,
    max_model_len: int = 256,
    arrivals: dict[int, tuple[str, int, int]] | None = None,
) -> dict:
    """``prompts`` through a scheduler over ``kv`` with a ``chunk``-token step budget.

    ``arrivals``: step -> (id, prompt length, priority) of a request added before that step
    (the scheduler then runs the priority policy). Returns the outputs, the requests it
    rejected, the scheduler's stats, the most live
    blocks of any scheduled request after a step's scheduling ("peak_live", its
    out-of-window blocks freed) and each request's most right after any allocation
    ("peak", before they are).
    """
    cfg = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=chunk,
        max_model_len=max_model_len,
        admission_headroom=0.0,
        resume_watermark=0.0,
        scheduling_policy="priority" if arrivals else "fcfs",
    )
    sched = Scheduler(cfg, kv)
    peak: dict[str, int] = {}
    allocate = kv.allocate_slots

    def live(rid: str) -> int:
        return sum(b != NULL_BLOCK_ID for b in kv.get_block_ids(rid))

    def counted(request, *args, **kwargs):  # type: ignore[no-untyped-def]
        got = allocate(request, *args, **kwargs)
        peak[request.request_id] = max(peak.get(request.request_id, 0), live(request.request_id))
        return got

    kv.allocate_slots = counted  # type: ignore[method-assign]
    rejected = []

    def add(rid: str, n: int, priority: int = 0) -> None:
        prompt = [(7 * i + len(rid)) % 40 + 1 for i in range(n)]
        try:
            sched.add_request(make_request(rid, prompt, max_tokens=max_tokens, priority=priority))
        except ValueError as e:
            rejected.append(str(e))

    for rid, n in prompts.items():
        add(rid, n)
    peak_live = 0
    outputs: dict[str, list[int]] = {}
    for step in range(3000):
        if step in (arrivals or {}):
            add(*arrivals[step])  # type: ignore[index]
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        kv.check_integrity()
        peak_live = max([peak_live, *(live(sr.request_id) for sr in out.scheduled)])
        # NOTE: a function of the sampled position, so recompute preemptions (a tight pool)
        # and chunk boundaries leave the token flow unchanged.
        sampled = {
            sr.request_id: ((sr.start_pos + len(sr.token_ids)) * 3) % 40 + 1
            for sr in out.scheduled
            if sr.sample
        }
        for r in sched.update_from_output(out, runner_output(sampled)):
            if r.status != RequestStatus.RUNNING:
                outputs[r.request_id] = list(r.output_token_ids)
        kv.check_integrity()
    assert not sched.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks
    return {
        "peak_live": peak_live,
        "peak": peak,
        "outputs": outputs,
        "rejected": rejected,
        "stats": sched.stats(),
    }


def test_scheduler_frees_out_of_window_blocks_and_bounds_live_blocks() -> None:
    bs, window, sinks = 4, 8, 4
    prompts = {"a": 30, "bb": 13, "ccc": 5}
    windowed = _run(WindowedKVCacheManager(64, bs, kv_window=KVWindow(window, sinks)), prompts, 30)
    dense = _run(KVCacheManager(64, bs, enable_prefix_caching=False), prompts, 30)
    # Token flow is unchanged by the block manager (the fake outputs depend on positions).
    assert windowed["outputs"] == dense["outputs"]
    # Live blocks of one request stay within sinks + window (+ the block being written).
    assert windowed["peak_live"] <= sinks // bs + window // bs + 2
    assert dense["peak_live"] == -(-60 // bs)
    assert windowed["stats"]["window_freed_blocks"] > 0


@given(
    bs=st.integers(1, 6),
    window=st.integers(1, 24),
    sinks=st.integers(0, 9),
    chunk=st.integers(1, 12),
    prompts=st.lists(st.integers(1, 80), min_size=1, max_size=3),
    max_tokens=st.integers(1, 60),
)
@settings(max_examples=examples(40), deadline=None)
def test_windowed_requests_longer_than_the_pool_run_within_their_live_bound(
    bs: int, window: int, sinks: int, chunk: int, prompts: list[int], max_tokens: int
) -> None:
    """With the step budget known, a windowed request is bounded by the blocks it holds at
    once (``max_live_blocks``), not by all of its tokens': a pool just that large runs it
    to the end with the token flow of an unwindowed run, and no allocation holds more."""
    win = KVWindow(window, sinks)
    probe = WindowedKVCacheManager(1, bs, kv_window=win, max_chunk=chunk)
    longest = max(prompts) + max_tokens
    pool = probe.max_live_blocks(longest)
    kv = WindowedKVCacheManager(pool, bs, kv_window=win, max_chunk=chunk)
    named = {"r" * (i + 1): n for i, n in enumerate(prompts)}
    got = _run(kv, named, max_tokens, chunk=chunk, max_model_len=400)
    dense = _run(
        KVCacheManager(-(-400 // bs) * 4, bs, enable_prefix_caching=False),
        named,
        max_tokens,
        chunk=chunk,
        max_model_len=400,
    )
    assert got["rejected"] == dense["rejected"] == []
    assert got["outputs"] == dense["outputs"]
    assert all(len(o) == max_tokens for o in got["outputs"].values())
    for rid, n in named.items():
        assert got["peak"][rid] <= kv.max_live_blocks(n + max_tokens)


def test_windowed_admission_and_stop_count_blocks_held_at_once() -> None:
    """A 200-token windowed request runs in an 8-block pool of 4-token blocks; without the
    step budget (``max_chunk``) the manager counts every block, as before; a bound past
    the pool is rejected by name; with no max_tokens the request runs to max_model_len."""
    win = KVWindow(8, 4)
    assert WindowedKVCacheManager(8, 4, kv_window=win, max_chunk=4).max_live_blocks(200) == 6
    assert WindowedKVCacheManager(8, 4, kv_window=win).max_live_blocks(200) == 50

    def one(max_tokens: int | None, chunk: int) -> dict:
        kv = WindowedKVCacheManager(8, 4, kv_window=win, max_chunk=chunk)
        return _run(kv, {"a": 20}, max_tokens, chunk=chunk, max_model_len=400)

    assert len(one(180, 4)["outputs"]["a"]) == 180
    assert one(180, 12)["rejected"] == [
        "request 'a' needs 10 KV blocks at once for 200 tokens, more than the whole pool "
        "(num_kv_blocks=8)"
    ]
    assert len(one(None, 4)["outputs"]["a"]) == 400 - 20


def test_a_windowed_request_past_the_pool_comes_back_after_a_recompute_preemption() -> None:
    """Preempted by recompute once it is past the pool's size, a windowed request
    recomputes its positions in budget-sized chunks within the same bound and finishes."""
    win, chunk = KVWindow(8, 4), 4
    kv = WindowedKVCacheManager(8, 4, kv_window=win, max_chunk=chunk)
    # "a" runs alone to ~100 tokens (past the pool's 32), then "b" (more important) arrives
    # and, lacking blocks, preempts it.
    got = _run(kv, {"a": 20}, 120, chunk=chunk, max_model_len=400, arrivals={90: ("b", 24, -1)})
    assert got["stats"]["preemptions_recompute"] >= 1
    assert {rid: len(o) for rid, o in got["outputs"].items()} == {"a": 120, "b": 120}
    assert got["peak"]["a"] <= kv.max_live_blocks(140) <= kv.num_blocks
    with pytest.raises(ValueError, match="max_chunk"):
        WindowedKVCacheManager(8, 4, kv_window=win, max_chunk=0)
