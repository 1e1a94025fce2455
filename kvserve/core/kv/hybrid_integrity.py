"""The invariant checks of ``HybridKVCacheManager`` (they raise ``IntegrityError``).

- The pool's own invariants (free list = the blocks at ref 0, cached ones behind).
- A block's ref count = the table entries holding it, in every group, + copy-on-write
  pins; a block is held by one group only; no table holds a block twice.
- Every group's table of a request has the same length.
- A full group's table holds no null entry; a sliding group's null entries lie out of the
  window at the request's computed tokens (``window.out_of_window_blocks``).
- Cached: ``block.cache_node`` is set exactly for the blocks a group's map holds, under
  the key it names; a cached block in a table sits where the request's own chained key of
  that block is its key (a table never holds a cached block of other tokens).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from kvserve.core.errors import IntegrityError
from kvserve.core.kv.block_pool import BlockPool, KVBlock
from kvserve.core.kv.hybrid_prefix import BlockHash, GroupPrefixCache
from kvserve.core.kv.kv_groups import KVGroupSpec
from kvserve.core.kv.tables import BlockTable
from kvserve.core.kv.window import out_of_window_blocks
from kvserve.request import Request


def check_hybrid(
    groups: Sequence[KVGroupSpec],
    pool: BlockPool,
    tables: Sequence[Mapping[str, BlockTable]],
    caches: Sequence[GroupPrefixCache],
    pinned: Iterable[KVBlock],
    block_size: int,
    hashes_of: Callable[[Request, int], list[BlockHash]],
) -> None:
    """Raise ``IntegrityError`` naming the first broken invariant (module docstring)."""
    pool.check_integrity()
    null = pool.null_block
    holders: Counter[int] = Counter(src.block_id for src in pinned)
    owner: dict[int, int] = {}
    lengths: dict[str, int] = {}
    for g, (spec, group_tables) in enumerate(zip(groups, tables, strict=True)):
        for rid, table in group_tables.items():
            blocks = table.blocks
            if lengths.setdefault(rid, len(blocks)) != len(blocks):
                raise IntegrityError(f"request {rid!r}: its groups' tables differ in length")
            ids = [b.block_id for b in blocks if b is not null]
            if len(set(ids)) != len(ids):
                raise IntegrityError(f"request {rid!r} group {g} holds a block twice: {ids}")
            for i in ids:
                if owner.setdefault(i, g) != g:
                    raise IntegrityError(f"block {i} is held by groups {owner[i]} and {g}")
            holders.update(ids)
            _check_nulls(spec, table, null, block_size, g)
            _check_cached(table, caches[g], null, block_size, hashes_of, g)
    for block in pool.blocks:
        if block.ref_cnt != holders[block.block_id]:
            raise IntegrityError(
                f"block {block.block_id}: ref {block.ref_cnt} but held by "
                f"{holders[block.block_id]} table entries / copy pins"
            )
    num_cached = 0
    for cache in caches:
        for key, block in cache.blocks.items():
            if block.cache_node != (cache.group_index, key):
                raise IntegrityError(f"block {block.block_id}: cache_node disagrees with its map")
        num_cached += len(cache)
    if num_cached != sum(b.cache_node is not None for b in pool.blocks):
        raise IntegrityError("pool blocks marked cached differ from the groups' maps")


def _check_nulls(
    spec: KVGroupSpec, table: BlockTable, null: KVBlock | None, block_size: int, g: int
) -> None:
    rid = table.request.request_id
    skippable = (
        out_of_window_blocks(table.request.num_computed_tokens, 0, spec.window, block_size)
        if spec.window is not None
        else range(0)
    )
    for i, block in enumerate(table.blocks):
        if block is null and i not in skippable:
            raise IntegrityError(
                f"request {rid!r} group {g}: block {i} was freed but is still inside the window"
            )


def _check_cached(
    table: BlockTable,
    cache: GroupPrefixCache,
    null: KVBlock | None,
    block_size: int,
    hashes_of: Callable[[Request, int], list[BlockHash]],
    g: int,
) -> None:
    request = table.request
    num_full = min(len(table.blocks), request.num_tokens // block_size)
    hashes: list[BlockHash] | None = None
    for i, block in enumerate(table.blocks):
        if block is null or block.cache_node is None:
            continue
        if i >= num_full:
            raise IntegrityError(
                f"request {request.request_id!r} group {g}: cached block {block.block_id} "
                "past its full blocks"
            )
        if hashes is None:
            hashes = hashes_of(request, num_full)
        if block.cache_node != (g, hashes[i]):
            raise IntegrityError(
                f"request {request.request_id!r} group {g}: cached block {block.block_id} "
                "holds other tokens than the request's"
            )
