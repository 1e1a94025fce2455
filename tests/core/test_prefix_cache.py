"""RadixPrefixCache: matching, Patricia edges, splits, salts, leaf eviction and merging."""

from __future__ import annotations

import pytest

from kvserve.core.kv.block_pool import KVBlock
from kvserve.core.kv.prefix_cache import PrefixCache, RadixPrefixCache

BS = 2


def chain(
    cache: RadixPrefixCache,
    tokens: list[int],
    blocks: list[KVBlock],
    salt: str | None = None,
    parent: KVBlock | None = None,
) -> list[bool]:
    """Insert ``blocks`` one after another for ``tokens`` (one block per BS tokens)."""
    out = []
    for i, block in enumerate(blocks):
        out.append(cache.insert(parent, salt, tuple(tokens[i * BS : (i + 1) * BS]), block))
        parent = block
    return out


def num_nodes(cache: RadixPrefixCache) -> int:
    return len(cache._nodes()) - len(cache._roots)  # non-root nodes


def test_radix_cache_satisfies_the_protocol() -> None:
    cache: PrefixCache = RadixPrefixCache(BS)
    assert cache.num_cached_blocks == 0


def test_chain_is_one_edge_and_match_is_block_aligned() -> None:
    cache = RadixPrefixCache(BS)
    b = [KVBlock(i) for i in range(3)]
    assert chain(cache, [1, 2, 3, 4, 5, 6], b) == [True, True, True]
    assert num_nodes(cache) == 1  # Patricia: an unbranched chain is one node
    assert cache.match([1, 2, 3, 4, 5, 6, 7], None, 10) == b
    assert cache.match([1, 2, 3, 4, 5], None, 10) == b[:2]  # partial last block: not matched
    assert cache.match([1, 2, 3, 9], None, 10) == b[:1]
    assert cache.match([1, 2, 3, 4, 5, 6], None, 2) == b[:2]  # max_blocks caps
    assert cache.match([2, 2], None, 10) == []
    assert cache.parent_block(b[0]) is None and cache.parent_block(b[2]) is b[1]
    cache.check_integrity()


def test_child_finds_the_cached_twin_of_a_path() -> None:
    cache = RadixPrefixCache(BS)
    b = [KVBlock(i) for i in range(5)]
    assert cache.child(None, None, (1, 2)) is None  # no root yet
    chain(cache, [1, 2, 3, 4, 5, 6], b[:3])
    chain(cache, [9, 9], [b[3]], parent=b[0])  # a branch after block 0
    assert cache.child(None, None, (1, 2)) is b[0]
    assert cache.child(b[0], None, (3, 4)) is b[1]  # a child edge's first block
    assert cache.child(b[0], None, (9, 9)) is b[3]
    assert cache.child(b[1], None, (5, 6)) is b[2]  # inside an edge
    assert cache.child(b[1], None, (5, 7)) is None
    assert cache.child(b[2], None, (7, 8)) is None  # a leaf's end
    assert cache.child(None, "tenant", (1, 2)) is None  # another salt's root
    assert not cache.insert(b[1], None, (5, 6), b[4])  # the path child() found
    with pytest.raises(ValueError, match="not cached"):
        cache.child(b[4], None, (1, 2))
    cache.check_integrity()


def test_divergence_splits_the_edge() -> None:
    cache = RadixPrefixCache(BS)
    b = [KVBlock(i) for i in range(5)]
    chain(cache, [1, 2, 3, 4, 5, 6], b[:3])
    # Same first block, different second: split after block 0.
    assert chain(cache, [9, 9], [b[3]], parent=b[0]) == [True]
    assert num_nodes(cache) == 3
    assert cache.match([1, 2, 9, 9], None, 10) == [b[0], b[3]]
    assert cache.match([1, 2, 3, 4, 5, 6], None, 10) == b[:3]
    assert cache.parent_block(b[3]) is b[0] and cache.parent_block(b[1]) is b[0]
    # The path already exists under another block: refused, nothing changes.
    assert not cache.insert(b[0], None, (3, 4), b[4])
    assert b[4].cache_node is None and cache.num_cached_blocks == 4
    cache.check_integrity()


def test_salts_never_share() -> None:
    cache = RadixPrefixCache(BS)
    a, b = KVBlock(0), KVBlock(1)
    assert cache.insert(None, None, (1, 2), a)
    assert cache.insert(None, "tenant", (1, 2), b)  # same tokens, other salt: a new path
    assert cache.match([1, 2, 3], None, 5) == [a]
    assert cache.match([1, 2, 3], "tenant", 5) == [b]
    assert cache.match([1, 2, 3], "other", 5) == []
    cache.check_integrity()


def test_evict_only_leaves_then_prune_and_merge() -> None:
    cache = RadixPrefixCache(BS)
    b = [KVBlock(i) for i in range(5)]
    chain(cache, [1, 2, 3, 4, 5, 6], b[:3])
    chain(cache, [9, 9, 8, 8], b[3:5], parent=b[0])
    with pytest.raises(AssertionError, match="cached children"):
        cache.evict(b[0])
    with pytest.raises(AssertionError, match="cached children"):
        cache.evict(b[1])  # not the last block of its edge
    cache.evict(b[4])
    cache.evict(b[3])  # the branch is gone: b[0]'s edge merges with its other child
    assert num_nodes(cache) == 1 and cache.num_cached_blocks == 3
    assert cache.match([1, 2, 3, 4, 5, 6], None, 10) == b[:3]
    assert b[3].cache_node is None and b[4].cache_node is None
    cache.check_integrity()
    for blk in reversed(b[:3]):
        cache.evict(blk)
    assert cache.num_cached_blocks == 0 and cache.dump() == []  # empty root dropped too
    cache.check_integrity()


def test_insert_validates_its_arguments() -> None:
    cache = RadixPrefixCache(BS)
    a = KVBlock(0)
    with pytest.raises(ValueError, match="only full blocks"):
        cache.insert(None, None, (1,), a)
    with pytest.raises(ValueError, match="not cached"):
        cache.insert(KVBlock(5), None, (1, 2), a)
    assert cache.insert(None, None, (1, 2), a)
    with pytest.raises(ValueError, match="already cached"):
        cache.insert(None, None, (3, 4), a)


def test_clear_forgets_everything_and_dump_describes_paths() -> None:
    cache = RadixPrefixCache(BS)
    b = [KVBlock(i) for i in range(2)]
    chain(cache, [1, 2, 3, 4], b, salt="s")
    assert cache.dump() == [("s", [(0, (1, 2), 0), (1, (3, 4), 1)])]
    cache.clear()
    assert cache.num_cached_blocks == 0 and all(blk.cache_node is None for blk in b)
    cache.check_integrity()


def test_check_integrity_catches_a_stale_block_link() -> None:
    cache = RadixPrefixCache(BS)
    a = KVBlock(0)
    cache.insert(None, None, (1, 2), a)
    a.cache_node = None
    with pytest.raises(AssertionError, match="does not point at its node"):
        cache.check_integrity()
