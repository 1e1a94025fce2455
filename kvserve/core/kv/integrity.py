"""The block-table invariant checks of ``KVCacheManager`` (they raise ``IntegrityError``).

The functions below take the manager's state as arguments (they read no private
attribute); ``KVCacheManager.check_integrity`` calls them.

The invariants of ``KVCacheManager`` (``check_integrity``):

- A block's ref count = block tables holding it + pending copy-on-write sources pinned
  until ``take_pending_copies()``. Ref 0 <=> in the pool's free list. The null block is the
  pool's (held forever) and may appear only where ``_skipped_blocks`` allows.
- Writable = ref 1 and not cached. Cached blocks and shared blocks are never written: a
  write goes to a fresh block, with a copy when the block already holds computed tokens.
- Each table starts with a run of cached blocks that is a root path of the prefix cache,
  and holds no cached block after it; its first ``num_cached_blocks`` are exactly what the
  cache matches for the request's own tokens and salt.
- Ancestor closure: a held cached block's parent is held; a free cached block comes before
  its free parent in the free list, so the pool only ever evicts device leaves.
- Residency: a cached device block's cached parent is a device block (host blocks have only
  host children), so a match is device blocks then host blocks. Host-tier invariants:
  ``core/host_prefix.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvserve.core.errors import IntegrityError
from kvserve.core.kv.block_pool import BlockPool, KVBlock
from kvserve.core.kv.prefix_cache import PrefixCache, describe
from kvserve.core.kv.tables import BlockTable


def check_ref_counts(
    tables: Iterable[BlockTable], pool: BlockPool, pinned: Iterable[KVBlock]
) -> None:
    """A block's ref count = tables holding it + copy-on-write pins; no table holds one twice.

    The pool's null block (a skipped table entry) is held by the pool itself, never counted.
    """
    null = pool.null_block
    holders: Counter[int] = Counter()
    for table in tables:
        ids = [b.block_id for b in table.blocks if b is not null]
        if len(set(ids)) != len(ids):
            raise IntegrityError(f"request {table.request.request_id!r} holds a block twice: {ids}")
        holders.update(ids)
    holders.update(src.block_id for src in pinned)
    for block in pool.blocks:
        if block is not null and block.ref_cnt != holders[block.block_id]:
            raise IntegrityError(
                f"block {block.block_id}: ref {block.ref_cnt} but held by "
                f"{holders[block.block_id]} tables / copy pins"
            )


def check_table(
    table: BlockTable,
    cache: PrefixCache,
    block_size: int,
    null_block: KVBlock | None,
    skippable: range,
) -> None:
    """A table is a root path of cached blocks, then uncached ones; null entries only where
    ``skippable`` (the manager's ``_skipped_blocks``) allows; its cached run is what its
    own tokens match."""
    rid = table.request.request_id
    blocks = table.blocks
    for i, block in enumerate(blocks):
        if block is null_block and i not in skippable:
            raise IntegrityError(
                f"request {rid!r}: block {i} was freed but is still inside the window"
            )
    num_leading = 0
    while num_leading < len(blocks) and blocks[num_leading].cache_node is not None:
        num_leading += 1
    for i in range(num_leading):
        want_parent = blocks[i - 1] if i else None
        if cache.parent_block(blocks[i]) is not want_parent:
            raise IntegrityError(
                f"request {rid!r}: cached block {blocks[i].block_id} is not on its path"
            )
    for block in blocks[num_leading:]:
        if block.cache_node is not None:
            raise IntegrityError(
                f"request {rid!r}: cached block {block.block_id} after an uncached one"
            )
    n = table.num_cached_blocks
    if n > num_leading or n > table.num_full_checked:
        raise IntegrityError(f"request {rid!r}: num_cached_blocks={n} is inconsistent")
    request = table.request
    if n * block_size > request.num_tokens:
        raise IntegrityError(f"request {rid!r}: cached past its end")
    matched = cache.match(table.token_ids(), request.cache_salt, n)
    if matched != blocks[:n]:  # KVBlock compares by identity
        raise IntegrityError(f"request {rid!r}: its cached blocks are not what its tokens match")


def check_lookahead(table: BlockTable, block_size: int) -> None:
    """Speculative decoding: a table with draft slots (``num_lookahead``) holds no block past
    the request's known tokens plus those slots, and no cached block reaches past its known
    tokens (``check_table``: cached blocks are what its own tokens match, so never a draft)."""
    if not table.num_lookahead:
        return
    request = table.request
    rid = request.request_id
    end = request.num_tokens + request.num_output_placeholders + table.num_lookahead
    if len(table.blocks) > -(-end // block_size):
        raise IntegrityError(
            f"request {rid!r}: {len(table.blocks)} blocks for {end} tokens with lookahead"
        )
    for i, block in enumerate(table.blocks):
        if block.cache_node is not None and (i + 1) * block_size > request.num_tokens:
            raise IntegrityError(f"request {rid!r}: cached block {block.block_id} holds a draft")


def check_eviction_order(pool: BlockPool, cache: PrefixCache) -> None:
    """Held cached blocks have held parents; free ones precede their free parents; a cached
    device block's parent is a device block."""
    position = {b.block_id: i for i, b in enumerate(pool.free_blocks())}
    for block in pool.blocks:
        if block.cache_node is None:
            continue
        parent = cache.parent_block(block)
        if parent is None:
            continue
        if not isinstance(parent, KVBlock):
            raise IntegrityError(
                f"cached block {block.block_id} has a host-resident parent {describe(parent)}"
            )
        if block.ref_cnt > 0:
            if parent.ref_cnt == 0:
                raise IntegrityError(
                    f"cached block {block.block_id} is held but its parent {parent.block_id} "
                    "is free (ancestor closure broken)"
                )
        elif parent.ref_cnt == 0 and position[block.block_id] >= position[parent.block_id]:
            raise IntegrityError(
                f"free cached block {block.block_id} would be evicted after its parent "
                f"{parent.block_id}"
            )


def check_cached_counts(
    pool: BlockPool, num_host_cached: int, cache: PrefixCache, enable_prefix_caching: bool
) -> None:
    """The pool's and the host tier's cached marks add up to what the prefix cache maps,
    and nothing is cached with caching off."""
    num_cached = sum(b.cache_node is not None for b in pool.blocks)
    if num_cached + num_host_cached != cache.num_cached_blocks:
        raise IntegrityError(
            f"{num_cached} pool blocks and {num_host_cached} host blocks are marked "
            f"cached, the prefix cache maps {cache.num_cached_blocks}"
        )
    if not enable_prefix_caching and num_cached:
        raise IntegrityError("caching is off but blocks cached")
