"""Prefix caching of the hybrid KV cache: chained block hashes and hits across groups.

A sliding-window group frees blocks from the middle of a request's table (the window's
tail moves), so its cached blocks cannot form the root paths the radix tree
(``prefix_cache.py``) requires. The hybrid manager keys cached blocks by a *chained hash*
instead, as vLLM v1 does: block i's key digests the salt and every token of blocks 0..i, so
a key names exactly what a block's K/V depends on, and any cached block can be evicted on
its own (no ancestor has to outlive it). Each group has its own map from key to block.

A prefix hit of ``h`` blocks lets the request start computing at position ``h *
block_size``; it needs what that next token reads, in every group (``longest_hit``):

- a full-attention group: blocks ``0 .. h-1``, all cached;
- a sliding group of window W: only the blocks holding positions ``h*bs - W + 1 ..
  h*bs - 1`` (``first_needed``); the ones before stay null in the table.

The hit is the largest ``h`` every group allows. A full group allows every ``h`` up to its
longest cached run; a sliding group allows ``h`` when the run of cached blocks ending at
block ``h - 1`` reaches back to ``first_needed(h)``. As in vLLM's
``HybridKVCacheCoordinator.find_longest_cache_hit``, the groups are asked in turn with the
bound the others left until none lowers it (a lower ``h`` needs other sliding blocks).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from kvserve.core.kv.block_pool import KVBlock
from kvserve.core.kv.kv_groups import KVGroupSpec
from kvserve.request import Request

BlockHash = bytes


def first_needed(num_hit_blocks: int, window: int, block_size: int) -> int:
    """The first block a sliding group of ``window`` must hold for a hit of that many
    blocks: the one of position ``h * block_size - window + 1`` (the oldest key the next
    token reads); every block before it is out of the window."""
    return max(0, num_hit_blocks * block_size - window + 1) // block_size


def extend_block_hashes(
    hashes: list[BlockHash], request: Request, num_blocks: int, block_size: int
) -> list[BlockHash]:
    """Extend ``hashes`` (the request's chained block keys so far) to ``num_blocks`` full
    blocks of its tokens; returns it. Key i = blake2b(key i-1 + block i's token ids)."""
    prev = hashes[-1] if hashes else _root(request.cache_salt)
    for i in range(len(hashes), num_blocks):
        tokens = array("q", request.token_ids_slice(i * block_size, (i + 1) * block_size))
        prev = hashlib.blake2b(prev + tokens.tobytes(), digest_size=16).digest()
        hashes.append(prev)
    return hashes


def _root(salt: str | None) -> BlockHash:
    """The chain's start: requests with different salts never share a key."""
    tag = b"\x00" if salt is None else b"\x01" + salt.encode()
    return hashlib.blake2b(tag, digest_size=16).digest()


class GroupPrefixCache:
    """One group's cached blocks by chained key. ``block.cache_node`` is ``(group, key)``
    exactly while the block is cached (the pool's eviction test)."""

    def __init__(self, group_index: int) -> None:
        self.group_index = group_index
        self.blocks: dict[BlockHash, KVBlock] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def get(self, key: BlockHash) -> KVBlock | None:
        return self.blocks.get(key)

    def insert(self, key: BlockHash, block: KVBlock) -> bool:
        """Cache ``block`` under ``key``; False, changing nothing, if the key is taken or the
        block is cached already."""
        if key in self.blocks or block.cache_node is not None:
            return False
        self.blocks[key] = block
        block.cache_node = (self.group_index, key)
        return True

    def evict(self, block: KVBlock) -> None:
        """Forget ``block`` (it must be cached here)."""
        node = block.cache_node
        if not isinstance(node, tuple) or node[0] != self.group_index:
            raise ValueError(f"block {block.block_id} is not cached in group {self.group_index}")
        del self.blocks[node[1]]
        block.cache_node = None

    def clear(self) -> None:
        for block in self.blocks.values():
            block.cache_node = None
        self.blocks.clear()


def _full_hit(cache: GroupPrefixCache, hashes: Sequence[BlockHash], bound: int) -> int:
    n = 0
    while n < bound and hashes[n] in cache.blocks:
        n += 1
    return n


def _sliding_hit(
    cache: GroupPrefixCache, hashes: Sequence[BlockHash], bound: int, window: int, bs: int
) -> int:
    """The largest h <= bound whose needed blocks (``first_needed(h) .. h-1``) are cached."""
    run = [0] * bound  # run[i]: consecutive cached blocks ending at block i
    for i in range(bound):
        if hashes[i] in cache.blocks:
            run[i] = run[i - 1] + 1 if i else 1
    for h in range(bound, 0, -1):
        if run[h - 1] >= h - first_needed(h, window, bs):
            return h
    return 0


def longest_hit(
    groups: Sequence[KVGroupSpec],
    caches: Sequence[GroupPrefixCache],
    hashes: Sequence[BlockHash],
    block_size: int,
) -> int:
    """Blocks of the longest prefix hit every group allows (module docstring)."""
    h = len(hashes)
    for spec, cache in zip(groups, caches, strict=True):
        if spec.window is None:
            h = _full_hit(cache, hashes, h)
    changed = True
    while changed and h:
        changed = False
        for spec, cache in zip(groups, caches, strict=True):
            if spec.window is not None:
                got = _sliding_hit(cache, hashes, h, spec.window, block_size)
                changed |= got < h
                h = got
    return h


def hit_blocks(
    groups: Sequence[KVGroupSpec],
    caches: Sequence[GroupPrefixCache],
    hashes: Sequence[BlockHash],
    num_hit: int,
    block_size: int,
    null: KVBlock,
) -> list[list[KVBlock]]:
    """Each group's table for a hit of ``num_hit`` blocks (``longest_hit``): cached blocks
    where the next token reads, ``null`` before a sliding group's ``first_needed``."""
    out = []
    for spec, cache in zip(groups, caches, strict=True):
        first = 0 if spec.window is None else first_needed(num_hit, spec.window, block_size)
        out.append([null] * first + [cache.blocks[hashes[i]] for i in range(first, num_hit)])
    return out
