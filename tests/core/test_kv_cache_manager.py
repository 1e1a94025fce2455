"""KVCacheManager scenarios with exact block ids, ref counts and eviction order."""

from __future__ import annotations

import pytest

from kvserve.bench.alloc import main as bench_main
from kvserve.bench.alloc import run_alloc_bench
from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.kv.metrics import kv_utilization
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=None)
SYS = list(range(100, 108))  # an 8-token "system prompt": two full blocks of 4


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), PARAMS, cache_salt=salt)


def admit(kv: KVCacheManager, r: Request, num_new: int | None = None) -> list[int]:
    """What the scheduler does on admission, then the step computing the tokens."""
    ids, num_hit = kv.get_computed_blocks(r)
    num_new = r.num_tokens - num_hit if num_new is None else num_new
    new = kv.allocate_slots(r, num_new, ids, num_hit)
    assert new is not None
    r.num_computed_tokens = num_hit + num_new
    kv.check_integrity()
    return new


def refs(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.block_pool.blocks]


def test_shared_system_prompt_is_stored_once() -> None:
    kv = KVCacheManager(10, 4)
    a = req("a", SYS + [1, 2, 3])
    assert admit(kv, a) == [0, 1, 2]
    b = req("b", SYS + [4, 5])
    assert kv.get_computed_blocks(b) == ([0, 1], 8)
    assert admit(kv, b) == [3]
    assert kv.get_block_ids("a") == [0, 1, 2] and kv.get_block_ids("b") == [0, 1, 3]
    assert refs(kv)[:5] == [2, 2, 1, 1, 0]
    snap = kv.snapshot()
    assert (snap["prefix_cache_queries"], snap["prefix_cache_hits"]) == (21, 8)
    assert snap["prefix_hit_rate"] == pytest.approx(8 / 21)
    assert snap["kv_usage"] == pytest.approx(4 / 10)
    # Distinct blocks 0..3 hold 4 + 4 + 3 + 2 tokens of 16 slots.
    assert snap["kv_utilization"] == pytest.approx(13 / 16)
    assert snap["fragmentation"] == pytest.approx(3 / 16)
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    # Uncached partial blocks first (3 freed last, so first), then the cached prompt,
    # its tail (1) before its head (0).
    assert kv.block_pool.free_block_ids() == [3, 2, 4, 5, 6, 7, 8, 9, 1, 0]
    assert kv.usage == 0.0 and kv.snapshot()["kv_utilization"] == 0.0


def test_partial_block_prompts_share_only_full_blocks() -> None:
    kv = KVCacheManager(8, 4)
    a = req("a", [1, 2, 3, 4, 5, 6])
    admit(kv, a)
    assert kv.prefix_cache.num_cached_blocks == 1  # block 1 holds 2 tokens: not cached
    b = req("b", [1, 2, 3, 4, 5, 6])
    assert kv.get_computed_blocks(b) == ([0], 4)
    assert admit(kv, b) == [2]
    assert refs(kv)[:3] == [2, 1, 1]


def test_full_hit_on_block_aligned_prompt_recomputes_the_last_block() -> None:
    kv = KVCacheManager(8, 4)
    a = req("a", SYS)
    assert admit(kv, a) == [0, 1]
    b = req("b", SYS)
    # Cap: one token must be computed, so the last block is dropped whole (no CoW).
    assert kv.get_computed_blocks(b) == ([0], 4)
    assert admit(kv, b) == [2]
    assert kv.get_block_ids("b") == [0, 2]
    # Block 2 duplicates cached block 1, so it stays out of the cache.
    assert kv.prefix_cache.num_cached_blocks == 2 and not kv.block_pool.blocks[2].is_cached
    assert kv.snapshot()["cow_copies"] == 0 and kv.take_pending_copies() == []
    # Not block-aligned: every full block is a hit and one token is left.
    c = req("c", SYS + [9])
    assert kv.get_computed_blocks(c) == ([0, 1], 8)
    assert admit(kv, c) == [3]
    assert kv.get_computed_blocks(req("d", [100])) == ([], 0)
    assert kv.get_computed_blocks(req("e", SYS[:4])) == ([], 0)


def test_get_computed_blocks_takes_no_reference_and_records_nothing() -> None:
    kv = KVCacheManager(8, 4)
    admit(kv, req("a", SYS))
    before = kv.dump_state()
    assert kv.get_computed_blocks(req("b", SYS + [1])) == ([0, 1], 8)
    assert kv.dump_state() == before


def test_eviction_under_pressure_is_lru_and_tail_first() -> None:
    kv = KVCacheManager(4, 4)
    a = req("a", list(range(1, 9)))
    assert admit(kv, a) == [0, 1]
    kv.free(a)
    assert kv.block_pool.free_block_ids() == [2, 3, 1, 0]
    b = req("b", list(range(11, 23)))
    assert admit(kv, b) == [2, 3, 1]  # never-used blocks first, then a's tail is evicted
    assert kv.snapshot()["prefix_cache_evictions"] == 1
    assert kv.get_computed_blocks(req("c", [1, 2, 3, 4, 50, 51])) == ([0], 4)
    kv.free(b)
    # a's head (used longest ago) is evicted before b's blocks, b's tail before its head.
    assert kv.block_pool.free_block_ids() == [0, 1, 3, 2]
    assert admit(kv, req("d", [60, 61, 62])) == [0]
    assert kv.get_computed_blocks(req("c", [1, 2, 3, 4, 50, 51])) == ([], 0)
    assert kv.get_computed_blocks(req("e", list(range(11, 24)))) == ([2, 3, 1], 12)
    assert kv.snapshot()["prefix_cache_evictions"] == 2


def test_a_held_block_is_never_evicted() -> None:
    kv = KVCacheManager(3, 4)
    a = req("a", SYS)
    admit(kv, a)
    assert kv.allocate_slots(req("b", list(range(12))), 12) is None  # needs 3, 1 free
    assert kv.get_computed_blocks(req("c", SYS + [1])) == ([0, 1], 8)


def test_salts_isolate_tenants() -> None:
    kv = KVCacheManager(12, 4)
    admit(kv, req("a", SYS + [1], salt="x"))
    assert kv.get_computed_blocks(req("b", SYS + [1], salt="y")) == ([], 0)
    assert kv.get_computed_blocks(req("c", SYS + [1])) == ([], 0)
    assert kv.get_computed_blocks(req("d", SYS + [1], salt="x")) == ([0, 1], 8)


def test_fork_then_copy_on_write_of_the_shared_partial_block() -> None:
    kv = KVCacheManager(8, 4)
    parent = req("p", [1, 2, 3, 4, 5, 6])
    admit(kv, parent)
    child = req("c", [1, 2, 3, 4, 5, 6])
    kv.fork(parent, child)
    assert kv.get_block_ids("c") == [0, 1] and refs(kv)[:2] == [2, 2]
    assert kv.snapshot()["fork_shared_blocks"] == 2
    child.num_computed_tokens = 5  # recompute the last prompt token, as the scheduler does
    assert kv.allocate_slots(child, 1) == [2]
    assert kv.get_block_ids("c") == [0, 2] and kv.get_block_ids("p") == [0, 1]
    assert refs(kv)[:3] == [2, 2, 1]  # block 1: the parent + the pin of the pending copy
    kv.check_integrity()
    assert kv.take_pending_copies() == [(1, 2)]
    assert kv.take_pending_copies() == []
    assert refs(kv)[:3] == [2, 1, 1] and kv.snapshot()["cow_copies"] == 1
    child.num_computed_tokens = 6
    # The parent's block 1 is now its own: decoding writes in place, no copy.
    parent.output_token_ids.append(7)
    assert kv.allocate_slots(parent, 1) == []
    assert kv.take_pending_copies() == []
    kv.check_integrity()


def test_copy_source_stays_pinned_until_the_copy_is_taken() -> None:
    kv = KVCacheManager(4, 4)
    parent = req("p", [1, 2, 3, 4, 5, 6])
    admit(kv, parent)
    child = req("c", [1, 2, 3, 4, 5, 6])
    kv.fork(parent, child)
    child.num_computed_tokens = 5
    assert kv.allocate_slots(child, 1) == [2]
    kv.free(parent)  # e.g. preempted later in the same step
    assert refs(kv)[:3] == [1, 1, 1] and 1 not in kv.block_pool.free_block_ids()
    kv.check_integrity()
    assert kv.take_pending_copies() == [(1, 2)]
    assert kv.block_pool.free_block_ids() == [1, 3]
    kv.check_integrity()


def test_fork_of_a_block_aligned_prompt_copies_the_cached_last_block() -> None:
    kv = KVCacheManager(8, 4)
    parent = req("p", SYS)
    admit(kv, parent)
    child = req("c", SYS)
    kv.fork(parent, child)
    child.num_computed_tokens = 7
    assert kv.allocate_slots(child, 1) == [2]  # block 1 is cached: never written in place
    assert kv.take_pending_copies() == [(1, 2)]
    child.num_computed_tokens = 8
    assert kv.dump_state()["tables"]["c"] == ([0, 2], 1, 2)  # (ids, cached, offered)
    assert kv.prefix_cache.num_cached_blocks == 2  # block 2 duplicates block 1: uncached
    child.output_token_ids.append(9)
    assert kv.allocate_slots(child, 1) == [3]
    kv.check_integrity()


def test_a_duplicate_block_is_swapped_for_its_cached_twin_once_written() -> None:
    """Two requests computed the same prompt in one step (b was looked up before a's
    blocks were cached). b's copies stay out of the cache while this step writes them; at
    b's next offer it takes a's blocks, frees its copies and caches on a's path."""
    kv = KVCacheManager(10, 4)
    a = req("a", SYS + [1])
    assert admit(kv, a) == [0, 1, 2]
    b = req("b", SYS + [2])
    assert kv.allocate_slots(b, 9) == [3, 4, 5]  # the same step: no hit
    b.num_computed_tokens = 9
    assert kv.dump_state()["tables"]["b"] == ([3, 4, 5], 0, 2)  # (ids, cached, offered)
    b.output_token_ids.extend([7, 8, 9])
    assert kv.allocate_slots(b, 3) == []  # block 5 fills up: b offers again
    b.num_computed_tokens = 12
    kv.check_integrity()
    assert kv.dump_state()["tables"]["b"] == ([0, 1, 5], 3, 3)
    assert refs(kv)[:6] == [2, 2, 1, 0, 0, 1]
    assert kv.block_pool.free_block_ids() == [4, 3, 6, 7, 8, 9]  # the copies: reused first
    assert kv.snapshot()["dedup_blocks"] == 2
    # b's whole conversation is now one cached path: a follow-up hits all of it.
    assert kv.get_computed_blocks(req("c", SYS + [2, 7, 8, 9, 5])) == ([0, 1, 5], 12)


def test_every_fork_holding_a_duplicate_takes_the_twin() -> None:
    kv = KVCacheManager(10, 4)
    admit(kv, req("a", SYS + [1]))
    p = req("p", SYS + [2])
    assert kv.allocate_slots(p, 9) == [3, 4, 5]  # duplicates of a's 0 and 1
    p.num_computed_tokens = 9
    c = req("c", SYS + [2])
    kv.fork(p, c)
    p.output_token_ids.extend([7, 8, 9])
    assert kv.allocate_slots(p, 3) == [6]  # the shared partial block 5 is copied on write
    kv.check_integrity()
    tables = kv.dump_state()["tables"]
    assert tables["p"] == ([0, 1, 6], 3, 3) and tables["c"] == ([0, 1, 5], 0, 0)
    assert refs(kv)[:7] == [3, 3, 1, 0, 0, 2, 1]  # 5: c's and the copy's pin
    assert kv.take_pending_copies() == [(5, 6)]
    assert kv.snapshot()["dedup_blocks"] == 2
    kv.check_integrity()


def test_a_cached_block_held_once_is_still_copied_not_written() -> None:
    kv = KVCacheManager(8, 4)
    parent = req("p", SYS)
    admit(kv, parent)
    child = req("c", SYS)
    kv.fork(parent, child)
    kv.free(parent)  # the parent finished before the child ran: block 1 has ref 1
    child.num_computed_tokens = 7
    assert refs(kv)[:2] == [1, 1] and kv.block_pool.blocks[1].is_cached
    assert kv.allocate_slots(child, 1) == [2]
    assert kv.take_pending_copies() == [(1, 2)]
    assert kv.block_pool.free_block_ids()[-1] == 1  # still cached, now evictable
    kv.check_integrity()


def test_swap_out_and_in_reuses_blocks_still_cached() -> None:
    kv = KVCacheManager(6, 4, num_host_blocks=4)
    a = req("a", list(range(10)))
    admit(kv, a)
    assert kv.swap_out(a) == [(0, 0), (1, 1), (2, 2)]
    assert kv.num_swapped_blocks(a) == 3 and kv.get_block_ids("a") == []
    assert kv.block_pool.free_block_ids() == [2, 3, 4, 5, 1, 0]
    assert kv.num_free_host_blocks == 1 and kv.usage == 0.0
    kv.check_integrity()
    assert kv.swap_in(a) == [(2, 2)]  # blocks 0, 1 are still cached: no copy needed
    assert kv.get_block_ids("a") == [0, 1, 2] and kv.num_swapped_blocks(a) == 0
    snap = kv.snapshot()
    assert (snap["swap_out_blocks"], snap["swap_in_blocks"]) == (3, 1)
    assert kv.num_free_host_blocks == 4
    kv.check_integrity()


def test_swap_in_after_eviction_copies_everything_and_recaches() -> None:
    kv = KVCacheManager(6, 4, num_host_blocks=4)
    a = req("a", list(range(10)))
    admit(kv, a)
    kv.swap_out(a)
    b = req("b", list(range(50, 74)))
    assert admit(kv, b) == [2, 3, 4, 5, 1, 0]  # evicts a's cached blocks
    before = kv.dump_state()
    assert kv.swap_in(a) is None
    assert kv.dump_state() == before
    kv.free(b)
    assert kv.block_pool.free_block_ids() == [0, 1, 5, 4, 3, 2]
    assert kv.swap_in(a) == [(0, 0), (1, 1), (2, 5)]
    assert kv.get_computed_blocks(req("c", list(range(10)))) == ([0, 1], 8)
    kv.check_integrity()


def test_swap_out_without_host_room_changes_nothing() -> None:
    kv = KVCacheManager(6, 4, num_host_blocks=2)
    a = req("a", list(range(10)))
    admit(kv, a)
    before = kv.dump_state()
    assert kv.swap_out(a) is None
    assert kv.dump_state() == before


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(4, 4)
    a = req("a", SYS)
    admit(kv, a)
    b = req("b", SYS[:4] + list(range(8)))
    ids, num_hit = kv.get_computed_blocks(b)
    assert (ids, num_hit) == ([0], 4)
    before = kv.dump_state()
    assert kv.allocate_slots(b, 8, ids, num_hit, reserve=1) is None  # 2 needed + 1 kept > 2
    assert kv.dump_state() == before
    assert kv.snapshot()["prefix_cache_queries"] == 8  # only a's query was recorded
    assert kv.allocate_slots(b, 8, ids, num_hit) == [2, 3]
    assert refs(kv) == [2, 1, 1, 1]


def test_failed_copy_on_write_changes_nothing() -> None:
    kv = KVCacheManager(2, 4)
    parent = req("p", [1, 2, 3, 4, 5, 6])
    admit(kv, parent)
    child = req("c", [1, 2, 3, 4, 5, 6])
    kv.fork(parent, child)
    child.num_computed_tokens = 5
    before = kv.dump_state()
    assert kv.allocate_slots(child, 1) is None  # the copy needs a block; none is free
    assert kv.dump_state() == before
    kv.free(parent)
    assert kv.allocate_slots(child, 1) == []  # now the only holder: written in place
    kv.check_integrity()


def test_bad_arguments_raise_clear_errors() -> None:
    kv = KVCacheManager(8, 4, num_host_blocks=2)
    a = req("a", SYS + [1])
    admit(kv, a)
    b = req("b", SYS + [1])
    with pytest.raises(ValueError, match="num_new_computed_tokens=4 but 2 computed"):
        kv.allocate_slots(b, 1, [0, 1], 4)
    with pytest.raises(ValueError, match="already has a block table"):
        kv.allocate_slots(a, 1, [0], 4)
    with pytest.raises(ValueError, match="must all be >= 0"):
        kv.allocate_slots(b, -1)
    with pytest.raises(ValueError, match="not a block id"):
        kv.allocate_slots(b, 1, [99], 4)
    with pytest.raises(ValueError, match="no longer in the prefix cache"):
        kv.allocate_slots(b, 1, [2], 4)
    with pytest.raises(ValueError, match="no device block table"):
        kv.fork(b, req("c", SYS))
    with pytest.raises(ValueError, match="differ"):
        kv.fork(a, req("c", [0] * 9))
    with pytest.raises(ValueError, match="not swapped out"):
        kv.swap_in(a)
    with pytest.raises(ValueError, match="no device block table"):
        kv.swap_out(b)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(8, 0)
    with pytest.raises(ValueError, match="num_host_blocks"):
        KVCacheManager(8, 4, num_host_blocks=-1)
    kv.free(req("unknown", [1]))  # unknown ids are a no-op
    kv.check_integrity()


def test_disabled_prefix_caching_shares_nothing() -> None:
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    admit(kv, req("a", SYS + [1]))
    assert kv.get_computed_blocks(req("b", SYS + [1])) == ([], 0)
    assert kv.prefix_cache.num_cached_blocks == 0
    assert kv.snapshot()["prefix_cache_queries"] == 0


def test_snapshot_has_exactly_the_contract_keys() -> None:
    kv = KVCacheManager(8, 4, num_host_blocks=3)
    snap = kv.snapshot()
    assert set(snap) == {
        "num_kv_blocks", "block_size", "num_free_blocks", "kv_usage", "kv_utilization",
        "fragmentation", "prefix_cache_queries", "prefix_cache_hits", "prefix_hit_rate",
        "prefix_cache_evictions", "cow_copies", "fork_shared_blocks", "swap_out_blocks",
        "swap_in_blocks", "num_host_blocks", "num_free_host_blocks", "alloc_time_s",
        "alloc_calls", "device_hit_tokens", "host_hit_tokens", "host_cache_blocks",
        "host_cache_evictions", "offload_blocks", "load_blocks", "dedup_blocks",
    }  # fmt: skip
    assert (snap["num_kv_blocks"], snap["num_free_blocks"], snap["num_free_host_blocks"]) == (
        8,
        8,
        3,
    )
    assert snap["kv_usage"] == snap["kv_utilization"] == snap["fragmentation"] == 0.0
    a = req("a", [1, 2, 3])
    assert kv.allocate_slots(a, 3) == [0]
    snap = kv.snapshot()  # allocated, nothing computed yet: all waste
    assert (snap["kv_utilization"], snap["fragmentation"]) == (0.0, 1.0)
    assert snap["alloc_calls"] == 1 and snap["alloc_time_s"] > 0.0
    a.num_computed_tokens = 3
    assert kv.snapshot()["fragmentation"] == pytest.approx(1 / 4)


def test_kv_utilization_counts_shared_blocks_once() -> None:
    # Two tables share block 7 (full); one has computed 2 tokens into block 8.
    assert kv_utilization([([7, 8], 6), ([7], 4)], 4) == pytest.approx(6 / 8)
    assert kv_utilization([([7, 8], 4)], 4) == pytest.approx(4 / 8)  # 8 allocated, empty
    assert kv_utilization([], 4) == 0.0


def test_reset_prefix_cache_only_when_idle() -> None:
    kv = KVCacheManager(8, 4)
    a = req("a", SYS + [1])
    admit(kv, a)
    assert not kv.reset_prefix_cache()
    assert kv.prefix_cache.num_cached_blocks == 2
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.prefix_cache.num_cached_blocks == 0
    assert kv.get_computed_blocks(req("b", SYS + [1])) == ([], 0)
    kv.check_integrity()


def test_check_integrity_names_a_broken_ref_count() -> None:
    kv = KVCacheManager(8, 4)
    admit(kv, req("a", SYS + [1]))
    kv.block_pool.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError, match="block 0: ref 2 but held by 1"):
        kv.check_integrity()


def test_num_blocks_for() -> None:
    kv = KVCacheManager(8, 4)
    assert [kv.num_blocks_for(n) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="num_tokens"):
        kv.num_blocks_for(-1)


def test_alloc_bench_reports_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    figures = run_alloc_bench(num_blocks=32, block_size=4, blocks_per_request=8, num_rounds=6)
    for name in (
        "pool_alloc_free_us_per_block",
        "alloc_free_us_per_block",
        "decode_alloc_us_per_token",
        "prefix_match_us_per_block",
    ):
        assert figures[name] > 0.0
    assert figures["evictions"] > 0  # 6 rounds x 8 blocks through a 32-block pool
    assert bench_main(["--num-blocks", "16", "--block-size", "2", "--rounds", "2",
                       "--blocks-per-request", "4"]) == 0  # fmt: skip
    assert "prefix_match_us_per_block" in capsys.readouterr().out
