"""Where block tables meet the prefix cache: resolving prefix hits and caching full blocks.

Functions of public state only, called by ``KVCacheManager``:

- ``match_prefix`` / ``device_prefix``: the cached blocks a request's tokens match.
- ``resolve_prefix_hits``: validate ``allocate_slots``' ``new_computed_blocks`` (from
  ``get_computed_blocks``) and turn the ids into device blocks then host blocks.
- ``cache_full_blocks``: offer a table's newly full blocks to the prefix cache.
- ``forget_blocks``: take unwritten blocks (a failed step's) out of the prefix cache.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from kvserve.core.kv.block_pool import BlockPool, KVBlock
from kvserve.core.kv.host_tier import HostBlock, HostTier
from kvserve.core.kv.prefix_cache import CacheEntry, PrefixCache, describe
from kvserve.core.kv.tables import BlockTable, request_token_ids
from kvserve.request import Request


def host_block_ref(host_block_id: int) -> int:
    """How ``get_computed_blocks`` reports a host-resident prefix block: ``-1 - host id``."""
    return -1 - host_block_id


def match_prefix(cache: PrefixCache, request: Request, max_blocks: int) -> list[CacheEntry]:
    """The cached blocks of the request's longest block-aligned prefix, at most ``max_blocks``:
    device blocks, then host-resident ones."""
    if max_blocks <= 0:
        return []
    return cache.match(request_token_ids(request), request.cache_salt, max_blocks)


def device_prefix(blocks: list[CacheEntry]) -> list[KVBlock]:
    """The leading device-resident blocks of a match."""
    out: list[KVBlock] = []
    for b in blocks:
        if isinstance(b, HostBlock):
            break
        out.append(b)
    return out


def resolve_prefix_hits(
    request: Request,
    has_table: bool,
    computed_ids: list[int],
    num_new_computed_tokens: int,
    *,
    block_size: int,
    pool: BlockPool,
    host_tier: HostTier,
) -> tuple[list[KVBlock], list[HostBlock]]:
    """Validate ``allocate_slots``' prefix-hit arguments; resolve device and host hits.

    Raises ValueError naming the problem: hits for a request that already has a table or
    has computed tokens, a token count that is not ``len(ids) * block_size``, an id that is
    neither a device id nor a host reference (device ids first), or a block that has left
    the prefix cache since ``get_computed_blocks``.
    """
    if not computed_ids and not num_new_computed_tokens:
        return [], []
    rid = request.request_id
    if has_table:
        raise ValueError(
            f"new_computed_blocks given for request {rid!r}, which already has a block "
            "table: prefix hits join only on the first allocation"
        )
    if request.num_computed_tokens != 0:
        raise ValueError(
            f"request {rid!r} has num_computed_tokens={request.num_computed_tokens}; "
            "prefix hits join only a request that has computed nothing"
        )
    if num_new_computed_tokens != len(computed_ids) * block_size:
        raise ValueError(
            f"num_new_computed_tokens={num_new_computed_tokens} but "
            f"{len(computed_ids)} computed blocks hold {len(computed_ids) * block_size}"
        )
    blocks: list[KVBlock] = []
    host_hits: list[HostBlock] = []
    for block_id in computed_ids:
        entry: CacheEntry
        if not isinstance(block_id, int) or isinstance(block_id, bool):
            raise ValueError(f"new_computed_blocks: {block_id!r} is not a block id")
        if 0 <= block_id < pool.num_blocks and not host_hits:
            entry = pool.blocks[block_id]
        elif -host_tier.num_blocks <= block_id < 0:
            entry = host_tier.blocks[-1 - block_id]
        else:
            raise ValueError(
                f"new_computed_blocks: {block_id!r} is not a block id (device ids first, "
                "then host block references -1 - host id)"
            )
        if entry.cache_node is None:
            raise ValueError(
                f"new_computed_blocks: {describe(entry)} is no longer in the prefix cache "
                "(call get_computed_blocks() right before allocate_slots())"
            )
        if isinstance(entry, HostBlock):
            host_hits.append(entry)
        else:
            blocks.append(entry)
    return blocks, host_hits


def cache_full_blocks(
    cache: PrefixCache,
    table: BlockTable,
    num_full: int,
    block_size: int,
    pool: BlockPool,
    tables: Iterable[BlockTable],
    unwritten: Container[KVBlock],
) -> int:
    """Offer the table's full blocks [num_cached_blocks, num_full) to the prefix cache.

    A block whose path is already cached under another block (its *twin*: two requests
    computed the same tokens at once) is swapped for the twin once the table's own copy has
    been written (an earlier offer, so not this step's, and not in ``unwritten``: the
    blocks a swap-in of this step copies into): every table in ``tables`` that
    holds the copy (n > 1 forks share it, at the same index) takes a reference on the twin
    instead, and the blocks after it are offered on the twin's path. Until then the cached
    run stops there; it is retried when more blocks fill up. Returns the number of
    duplicates swapped for their twins.

    NOTE: stopping at a duplicate for good (as before) left every later block of that
    request out of the cache: of two chats that sent the same system prompt in one step,
    only one could ever hit on its conversation. A twin cached in this very step is as
    safe as a prefix hit on it (the step writes it before any attention reads it, and a
    fault of its writer fails its readers: ``RequestFailures.fail_faulted``); the
    table's own copy must not be, since this step would write its tokens into the twin.
    A host-resident twin is left alone (taking it needs a load).
    """
    written = table.num_full_checked  # blocks [0, written) were offered in an earlier call
    if num_full <= written:
        return 0
    table.num_full_checked = num_full
    i = table.num_cached_blocks
    blocks = table.blocks
    request = table.request
    bs = block_size
    parent = blocks[i - 1] if i else None
    num_swapped = 0
    while i < num_full:
        block = blocks[i]
        if block.cache_node is not None:
            break  # shared by fork under a longer path: not this request's to extend
        key = tuple(request.token_ids_slice(i * bs, (i + 1) * bs))
        if not cache.insert(parent, request.cache_salt, key, block):
            twin = cache.child(parent, request.cache_salt, key)
            if i >= written or block in unwritten or not isinstance(twin, KVBlock):
                break
            holders = [t for t in tables if len(t.blocks) > i and t.blocks[i] is block]
            pool.touch([twin] * len(holders))
            for t in holders:
                t.blocks[i] = twin
            pool.free([block] * len(holders))
            num_swapped += 1
            block = twin
        parent = block
        i += 1
    table.num_cached_blocks = i
    return num_swapped


def forget_blocks(
    cache: PrefixCache,
    host_tier: HostTier,
    blocks: list[KVBlock],
    tables: Iterable[BlockTable],
) -> int:
    """Take the first cached block of ``blocks`` and its whole subtree out of the prefix cache.

    For ``forget_unwritten``: the rest of its path goes too (descendants extend unwritten KV);
    forgotten host blocks are released, and every table in ``tables`` that shared a forgotten
    block ends its cached run before it. Returns the number of cache entries forgotten.
    """
    removed: list[CacheEntry] = []
    for block in blocks:
        if block.cache_node is not None:
            removed = cache.remove_subtree(block)
            break
    hosts = [b for b in removed if isinstance(b, HostBlock)]
    for host in hosts:
        host_tier.uncache(host)
    host_tier.release(hosts)
    if removed:
        for t in tables:
            n = 0
            while n < t.num_cached_blocks and t.blocks[n].cache_node is not None:
                n += 1
            t.num_cached_blocks = n
            t.num_full_checked = min(t.num_full_checked, n)
    return len(removed)
