"""BlockPool / FreeBlockQueue: exact ids, ref counts and eviction order."""

from __future__ import annotations

import pytest

from kvserve.core.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_o1_operations_keep_order_and_count() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4] and q.num_free_blocks == 5
    q.remove(blocks[2])  # from the middle
    assert q.popleft() is blocks[0]
    q.appendleft(blocks[0])
    q.append(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2] and q.num_free_blocks == 5
    q.check_integrity()
    with pytest.raises(ValueError, match="already in the free list"):
        q.append(blocks[3])
    for _ in range(5):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()
    with pytest.raises(ValueError, match="not in the free list"):
        q.remove(blocks[1])
    q.check_integrity()


def test_allocate_takes_front_and_sets_refs() -> None:
    pool = BlockPool(4)
    got = pool.allocate(3)
    assert ids(got) == [0, 1, 2]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 0]
    assert pool.num_free_blocks == 1
    with pytest.raises(ValueError, match="only 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1  # a refused allocation takes nothing
    pool.check_integrity()


def test_free_puts_uncached_first_and_cached_last_in_given_order() -> None:
    pool = BlockPool(6, on_evict=lambda b: setattr(b, "cache_node", None))
    a, b, c, d = pool.allocate(4)
    b.cache_node = c.cache_node = object()  # pretend the prefix cache maps b and c
    # A table [a, b, c, d] is freed tail first: d, c, b, a.
    pool.free([d, c, b, a])
    # Uncached d, a went to the front (a last, so first); cached c, b to the back, c first.
    assert pool.free_block_ids() == [0, 3, 4, 5, 2, 1]
    pool.check_integrity()


def test_touch_revives_a_free_cached_block_from_the_middle() -> None:
    pool = BlockPool(3, on_evict=lambda b: setattr(b, "cache_node", None))
    blocks = pool.allocate(3)
    for blk in blocks:
        blk.cache_node = object()
    pool.free(reversed(blocks))
    assert pool.free_block_ids() == [2, 1, 0]
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 1 and pool.free_block_ids() == [2, 0]
    pool.touch([blocks[1]])  # a held block just gains a reference
    assert blocks[1].ref_cnt == 2 and pool.num_free_blocks == 2
    pool.check_integrity()


def test_allocating_a_cached_block_evicts_it_first() -> None:
    evicted: list[int] = []

    def on_evict(block: KVBlock) -> None:
        evicted.append(block.block_id)
        block.cache_node = None

    pool = BlockPool(3, on_evict=on_evict)
    blocks = pool.allocate(3)
    blocks[0].cache_node = blocks[1].cache_node = object()
    pool.free([blocks[1], blocks[0], blocks[2]])
    assert pool.free_block_ids() == [2, 1, 0]
    got = pool.allocate(2)
    assert ids(got) == [2, 1] and evicted == [1] and pool.num_evictions == 1
    assert got[1].cache_node is None and got[1].ref_cnt == 1
    pool.check_integrity()


def test_double_free_and_bad_sizes_raise() -> None:
    pool = BlockPool(2)
    (blk,) = pool.allocate(1)
    pool.free([blk])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([blk])
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="num_blocks"):
            BlockPool(bad)  # type: ignore[arg-type]


def test_null_block_is_reserved_only_when_asked() -> None:
    assert BlockPool(3).null_block is None
    pool = BlockPool(3, reserve_null_block=True)
    assert pool.null_block is pool.blocks[0] and pool.null_block.ref_cnt == 1
    assert pool.num_usable_blocks == 2 and pool.num_free_blocks == 2
    assert ids(pool.allocate(2)) == [1, 2]
    with pytest.raises(ValueError, match="null block"):
        pool.free([pool.blocks[0]])
    pool.check_integrity()
    with pytest.raises(ValueError, match=">= 2"):
        BlockPool(1, reserve_null_block=True)


def test_check_integrity_catches_a_broken_ref_count() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool.blocks[1].ref_cnt = 1  # held but still linked in the free list
    with pytest.raises(AssertionError, match="free list with ref>0"):
        pool.check_integrity()


def test_check_integrity_catches_uncached_after_cached() -> None:
    pool = BlockPool(3)
    pool.blocks[0].cache_node = object()  # the front block claims to be cached
    with pytest.raises(AssertionError, match="follows a cached block"):
        pool.check_integrity()
