"""Contiguous per-request reservation: exact runs, fragmentation, freeing, swap, fork."""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.kv.contiguous import ContiguousKVCacheManager
from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.sched.scheduler import Scheduler
from kvserve.request import Request, RequestStatus
from tests.core.fake_runner import (
    Driver,
    FakeClock,
    FakeRunner,
    assert_pool_idle,
    expected_output,
    make_request,
)

VOCAB = 50


def prompt(n: int, base: int = 0) -> list[int]:
    return [(base * 7 + 3 * i + 1) % VOCAB for i in range(n)]


def req(rid: str, num_prompt: int, max_tokens: int | None, base: int = 0) -> Request:
    return make_request(rid, prompt(num_prompt, base), max_tokens=max_tokens)


def admit(kv: ContiguousKVCacheManager, r: Request, reserve: int = 0) -> list[int] | None:
    """First allocation for the whole prompt, as the scheduler does with an ample budget."""
    return kv.allocate_slots(r, r.num_prompt_tokens, reserve=reserve)


# ---------------------------------------------------------------- reservation


def test_first_allocation_reserves_one_run_for_prompt_plus_max_tokens() -> None:
    kv = ContiguousKVCacheManager(16, 4, max_model_len=40)
    a = req("a", 5, 6)  # 11 tokens -> 3 blocks
    b = req("b", 9, 8)  # 17 tokens -> 5 blocks
    c = req("c", 30, 20)  # 50 tokens, capped at max_model_len 40 -> 10 blocks
    assert [kv.num_reserved_blocks(r) for r in (a, b, c)] == [3, 5, 10]
    assert admit(kv, a) == [0, 1, 2]
    assert admit(kv, b) == [3, 4, 5, 6, 7]
    assert kv.num_free_blocks == 8 and kv.largest_free_run == 8
    before = kv.dump_state()
    assert admit(kv, c) is None  # 10 > 8 free: nothing changes
    assert kv.dump_state() == before
    kv.check_integrity()


def test_max_tokens_none_reserves_max_model_len_capped_at_the_pool() -> None:
    kv = ContiguousKVCacheManager(8, 4, max_model_len=20)
    assert kv.num_reserved_blocks(req("a", 3, None)) == 5  # 20 tokens
    kv = ContiguousKVCacheManager(8, 4, max_model_len=1000)
    r = req("b", 3, None)
    assert kv.num_reserved_blocks(r) == 8  # never more than the pool
    assert admit(kv, r) == list(range(8))
    kv.check_integrity()


def test_a_request_never_grows_and_cannot_pass_its_reservation() -> None:
    kv = ContiguousKVCacheManager(16, 4, max_model_len=64)
    r = req("a", 5, 6)
    assert admit(kv, r) == [0, 1, 2]
    r.num_computed_tokens = 5
    for _ in range(6):  # decode up to prompt + max_tokens = 11 tokens: no new block
        r.output_token_ids.append(1)
        assert kv.allocate_slots(r, 1) == []
        r.num_computed_tokens += 1
        assert kv.get_block_ids("a") == [0, 1, 2] and kv.num_free_blocks == 13
        kv.check_integrity()
    r.output_token_ids.append(1)  # 12 tokens: still 3 blocks of 4, fits
    assert kv.allocate_slots(r, 1) == []
    r.num_computed_tokens += 1
    with pytest.raises(ValueError, match="past its reservation of 3"):
        kv.allocate_slots(r, 1)


def test_free_returns_the_whole_run_and_utilization_is_stored_over_reserved() -> None:
    kv = ContiguousKVCacheManager(16, 4, max_model_len=64)
    a, b = req("a", 5, 6), req("b", 2, 2)  # 3 blocks (12 slots), 1 block (4 slots)
    admit(kv, a)
    admit(kv, b)
    a.num_computed_tokens, b.num_computed_tokens = 5, 2
    snap = kv.snapshot()
    assert snap["kv_usage"] == 4 / 16
    assert snap["kv_utilization"] == pytest.approx((5 + 2) / (12 + 4))
    assert snap["fragmentation"] == pytest.approx(1 - 7 / 16)
    kv.free(a)
    assert kv.num_free_blocks == 15 and kv.get_block_ids("a") == []
    assert kv.block_pool.free_map[:4] == bytearray([1, 1, 1, 0])
    kv.free(b)
    kv.free(b)  # unknown request: no-op
    assert_pool_idle(kv)
    assert kv.largest_free_run == 16


# ---------------------------------------------------------------- fragmentation


def test_no_contiguous_run_fails_although_enough_blocks_are_free() -> None:
    kv = ContiguousKVCacheManager(8, 2, max_model_len=64)
    rs = [req(f"r{i}", 2, 2, base=i) for i in range(4)]  # 4 tokens = 2 blocks each
    assert [admit(kv, r) for r in rs] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    kv.free(rs[1])
    kv.free(rs[3])  # free: 2, 3, 6, 7 (two runs of 2)
    big = req("big", 3, 3)  # 6 tokens = 3 blocks
    before = kv.dump_state()
    assert admit(kv, big) is None
    assert kv.dump_state()["tables"] == before["tables"]
    snap = kv.snapshot()
    assert snap["num_free_blocks"] == 4 and snap["largest_free_run_blocks"] == 2
    assert snap["external_fragmentation"] == pytest.approx(0.5)
    assert snap["fragmented_alloc_failures"] == 1
    small = req("small", 2, 2, base=9)
    assert admit(kv, small) == [2, 3]  # first fit: the lowest run
    kv.free(rs[2])  # free: 4, 5, 6, 7
    assert admit(kv, big) == [4, 5, 6]
    assert kv.snapshot()["fragmented_alloc_failures"] == 1
    kv.check_integrity()


def test_too_few_free_blocks_is_not_counted_as_fragmentation() -> None:
    kv = ContiguousKVCacheManager(4, 2, max_model_len=64)
    admit(kv, req("a", 2, 2))
    assert admit(kv, req("b", 3, 3)) is None  # 3 blocks wanted, 2 free in all
    assert kv.snapshot()["fragmented_alloc_failures"] == 0


def test_reserve_counts_free_blocks_beyond_what_the_step_fills() -> None:
    kv = ContiguousKVCacheManager(10, 4, max_model_len=64)
    r = req("a", 8, 8)  # run of 4 blocks; the 8-token prompt fills 2
    # needed (2) + reserve must be <= 10 free blocks.
    assert kv.allocate_slots(r, 8, reserve=9) is None
    assert kv.allocate_slots(r, 8, reserve=8) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="must all be >= 0"):
        kv.allocate_slots(req("b", 2, 2), 1, reserve=-1)


# ---------------------------------------------------------------- no sharing


def test_no_prefix_sharing() -> None:
    with pytest.raises(ValueError, match="enable_prefix_caching=False"):
        ContiguousKVCacheManager(8, 4, max_model_len=64, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="max_model_len"):
        ContiguousKVCacheManager(8, 4, max_model_len=0)
    kv = ContiguousKVCacheManager(16, 4, max_model_len=64)
    a, b = req("a", 9, 2), req("b", 9, 2)  # same prompt
    admit(kv, a)
    a.num_computed_tokens = 9
    assert kv.get_computed_blocks(b) == ([], 0)
    with pytest.raises(ValueError, match="shares no blocks"):
        kv.allocate_slots(b, 1, [0, 1], 8)
    assert admit(kv, b) == [3, 4, 5]
    assert kv.snapshot()["prefix_cache_queries"] == 0


def test_fork_child_gets_its_own_run_at_its_first_write() -> None:
    kv = ContiguousKVCacheManager(16, 4, max_model_len=64)
    parent = make_request("p", prompt(6), max_tokens=4, n=2)  # 10 tokens -> 3 blocks
    (child,) = parent.pending_children
    assert admit(kv, parent) == [0, 1, 2]
    parent.num_computed_tokens = 6
    kv.fork(parent, child)
    child.num_computed_tokens = 5  # recomputes the last prompt token
    assert kv.get_block_ids("p#1") == [0, 1, 2] and kv.num_free_blocks == 13
    kv.check_integrity()
    assert kv.allocate_slots(child, 1) == [3, 4, 5]
    # Blocks 0 and 1 hold the child's 5 computed tokens: copied; block 2 is just dropped.
    assert kv.take_pending_copies() == [(0, 3), (1, 4)]
    assert kv.get_block_ids("p#1") == [3, 4, 5] and kv.get_block_ids("p") == [0, 1, 2]
    assert [b.ref_cnt for b in kv.block_pool.blocks[:6]] == [1] * 6
    kv.check_integrity()
    kv.free(child)
    kv.free(parent)
    assert_pool_idle(kv)


# ---------------------------------------------------------------- swap


def test_swap_moves_only_computed_blocks_and_swap_in_takes_a_new_run() -> None:
    kv = ContiguousKVCacheManager(8, 4, max_model_len=64, num_host_blocks=4)
    a, b = req("a", 6, 10), req("b", 2, 2)  # 16 tokens = 4 blocks; 1 block
    assert admit(kv, a) == [0, 1, 2, 3]
    a.num_computed_tokens = 6  # 2 blocks hold K/V
    assert kv.swap_out(a) == [(0, 0), (1, 1)]
    assert kv.num_swapped_blocks(a) == 2 and kv.num_free_blocks == 8
    assert admit(kv, b) == [0]
    kv.check_integrity()
    assert kv.swap_in(a, reserve=6) is None  # 2 blocks to copy + 6 > 7 free
    assert kv.swap_in(a) == [(0, 1), (1, 2)]
    assert kv.get_block_ids("a") == [1, 2, 3, 4]
    kv.check_integrity()
    kv.free(a)
    kv.free(b)
    assert_pool_idle(kv)


def test_swap_in_fails_without_a_run() -> None:
    kv = ContiguousKVCacheManager(6, 2, max_model_len=64, num_host_blocks=4)
    a = req("a", 2, 2)  # 2 blocks
    admit(kv, a)
    a.num_computed_tokens = 2
    assert kv.swap_out(a) == [(0, 0)]
    fillers = [req(f"f{i}", 1, 1, base=i) for i in range(3)]  # 1 block each: 0, 1, 2
    for f in fillers:
        admit(kv, f)
    kv.free(fillers[1])  # free: 1, 3, 4, 5
    admit(kv, req("g", 2, 2, base=7))  # takes 3, 4; free: 1, 5
    assert kv.swap_in(a) is None
    assert kv.snapshot()["fragmented_alloc_failures"] == 1
    kv.check_integrity()


# ---------------------------------------------------------------- with the scheduler


def make_driver(
    kv: KVCacheManager, *, num_host_blocks: int = 0, **config: object
) -> tuple[Driver, Scheduler]:
    settings: dict = dict(
        max_num_seqs=16, max_num_batched_tokens=16, max_model_len=64, admission_headroom=0.0
    )
    settings.update(config)
    settings.setdefault("resume_watermark", settings["admission_headroom"])
    clock = FakeClock()
    scheduler = Scheduler(SchedulerConfig(**settings), kv, clock=clock)
    runner = FakeRunner(kv.num_blocks, kv.block_size, num_host_blocks, VOCAB)
    return Driver(scheduler, runner, clock), scheduler


def _trace() -> list[Request]:
    lengths = [(5, 12), (9, 3), (3, 20), (12, 6), (4, 4), (7, 15), (2, 9), (10, 2)]
    return [req(f"r{i}", p, m, base=i) for i, (p, m) in enumerate(lengths)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_scheduler_runs_a_trace_with_exact_outputs_and_no_preemption(mode: str) -> None:
    kv = ContiguousKVCacheManager(12, 4, max_model_len=64, num_host_blocks=12)
    d, s = make_driver(kv, num_host_blocks=12, preemption_mode=mode)
    trace = _trace()
    peak = 0

    def on_step(sched: object, touched: object) -> None:
        nonlocal peak
        peak = max(peak, s.num_running)
        # Every running request holds its whole reservation as one run.
        for r in s.running:
            ids = kv.get_block_ids(r.request_id)
            assert len(ids) == kv.num_reserved_blocks(r)
            assert ids == list(range(ids[0], ids[0] + len(ids)))

    d.on_step = on_step
    for r in trace:
        s.add_request(r)
    d.run()
    for r in trace:
        assert r.output_token_ids == expected_output(r, s, VOCAB), r.request_id
    assert s.totals.preemptions == 0  # a reservation never needs another block
    assert 1 <= peak < len(trace)
    assert_pool_idle(kv)


def test_paged_fits_more_requests_than_contiguous_in_the_same_pool() -> None:
    peaks = {}
    for name in ("paged", "contiguous"):
        kv: KVCacheManager
        if name == "paged":
            kv = KVCacheManager(12, 4, enable_prefix_caching=False)
        else:
            kv = ContiguousKVCacheManager(12, 4, max_model_len=64)
        d, s = make_driver(kv)
        trace = _trace()
        peak = 0

        def on_step(sched: object, touched: object, s: Scheduler = s) -> None:
            nonlocal peak
            peak = max(peak, s.num_running)

        d.on_step = on_step
        for r in trace:
            s.add_request(r)
        d.run()
        assert all(r.output_token_ids == expected_output(r, s, VOCAB) for r in trace)
        peaks[name] = peak
    assert peaks["paged"] > peaks["contiguous"]


def test_parallel_sampling_through_the_scheduler() -> None:
    kv = ContiguousKVCacheManager(16, 4, max_model_len=64)
    d, s = make_driver(kv)
    r = make_request("p", prompt(6), max_tokens=5, n=3)
    samples = [r, *r.pending_children]
    s.add_request(r)
    d.run()
    for x in samples:
        assert x.output_token_ids == expected_output(x, s, VOCAB), x.request_id
    assert kv.snapshot()["cow_copies"] == 2 * 2  # each child copies its 2 computed blocks
    assert_pool_idle(kv)


@pytest.mark.parametrize("seed", range(12))
def test_random_traces_keep_invariants_and_outputs(seed: int) -> None:
    """Random lengths, n > 1 forks (whose unsharing can preempt), aborts, both modes."""
    import random

    rng = random.Random(seed)
    mode = "swap" if seed % 2 else "recompute"
    num_blocks = rng.randint(8, 20)
    kv = ContiguousKVCacheManager(num_blocks, 2, max_model_len=32, num_host_blocks=8)
    d, s = make_driver(kv, num_host_blocks=8, preemption_mode=mode, max_num_batched_tokens=8)
    trace = []
    for i in range(10):
        r = make_request(
            f"r{i}",
            prompt(rng.randint(1, 8), base=i),
            max_tokens=rng.randint(1, 8),
            n=rng.choice([1, 1, 2]),
        )
        s.add_request(r)
        trace.extend([r, *r.pending_children])
    aborted = {f"r{rng.randint(0, 9)}"}
    for _ in range(3):
        d.step()
    s.finish_requests(aborted, RequestStatus.FINISHED_ABORTED)
    d.run()
    for r in trace:
        if r.request_id not in aborted and r.parent_id not in aborted:
            assert r.output_token_ids == expected_output(r, s, VOCAB), r.request_id
    assert_pool_idle(kv)


def test_priority_preempts_until_a_run_holds_the_important_reservation() -> None:
    # Two low-priority requests reserve 8 blocks each of 20; the urgent one needs a run of
    # 8 while 4 blocks are free: the priority policy must preempt, as with a paged pool.
    kv = ContiguousKVCacheManager(20, 4, max_model_len=80)
    d, scheduler = make_driver(kv, max_num_seqs=8, scheduling_policy="priority")
    low = [
        make_request(f"low{i}", [i + 1] * 4, max_tokens=28, priority=2, arrival_time=float(i))
        for i in range(2)
    ]
    for r in low:
        scheduler.add_request(r)
    d.step()
    urgent = make_request("urgent", [3] * 4, max_tokens=28, priority=0)
    scheduler.add_request(urgent)
    start = len(d.outputs)
    d.run()
    first = next(
        i for i, o in enumerate(d.outputs) if any(sr.request_id == "urgent" for sr in o.scheduled)
    )
    assert first - start <= 2 and scheduler.totals.priority_preemptions >= 1
    kv.check_integrity()
