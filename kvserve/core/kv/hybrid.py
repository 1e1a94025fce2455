"""``HybridKVCacheManager``: one block table per KV cache group over one shared block pool.

A hybrid model's layers are grouped by attention type (``kv_groups.py``): full attention,
or a sliding window W. Each group keeps its own table per request; every table draws from
the same ``BlockPool``, so a block id belongs to one group at a time and a request holds
``sum over groups`` blocks. The scheduler sees the same interface as ``KVCacheManager``
(``allocate_slots``, ``get_computed_blocks``, ``swap_out`` ...); ``get_block_ids`` is group
0's table and ``get_group_block_ids`` every group's (the runner builds one attention
metadata per group from them).

- Allocation is all-or-nothing across groups: every group's fresh blocks (new blocks and
  copy-on-write replacements) must fit the free blocks together, else nothing changes.
  All groups' tables have the same length (``ceil(tokens / block_size)``).
- A sliding group frees the blocks that left its window (``window.out_of_window_blocks``,
  the StreamingLLM manager's arithmetic, without sinks); their entries become the pool's
  null block. It frees them at the start of ``allocate_slots`` (as vLLM v1 does, by the
  tokens computed so far) and in ``remove_skipped_blocks``, so while it computes a chunk of
  C tokens it holds at most ``kv_groups.window_blocks(W, bs, C)`` blocks:
  ``ceil(W / bs) + 1`` for a decode.
- Prefix caching across groups (``hybrid_prefix.py``): chained block hashes, one map per
  group; a hit needs, in every group, the blocks the next token reads.
- Swap preemption moves each group's live blocks to the host tier and back (null entries
  stay null); fork shares every group's table; ``free`` releases every group, tail first.

Not supported here (ValueError at construction): the host prefix-offload tier. Swap-in
copies every block back (no prefix reuse at swap-in).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvserve.core.errors import IntegrityError
from kvserve.core.kv.block_pool import BlockPool, KVBlock
from kvserve.core.kv.block_tables import check_allocate_args, check_count
from kvserve.core.kv.host_tier import HostTier
from kvserve.core.kv.hybrid_figures import HybridFigures
from kvserve.core.kv.hybrid_integrity import check_hybrid
from kvserve.core.kv.hybrid_prefix import (
    BlockHash,
    GroupPrefixCache,
    extend_block_hashes,
    hit_blocks,
    longest_hit,
)
from kvserve.core.kv.hybrid_swap import HostGroups, HybridSwap
from kvserve.core.kv.kv_groups import KVGroupSpec, hybrid_blocks_per_request
from kvserve.core.kv.metrics import KVCacheCounters, ratio
from kvserve.core.kv.tables import BlockTable
from kvserve.core.kv.window import out_of_window_blocks
from kvserve.request import Request

__all__ = ["HybridKVCacheManager"]


class HybridKVCacheManager(HybridSwap, HybridFigures):
    """Per-group block tables over one pool. See the module docstring."""

    prefix_caching_conflict = None

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        groups: Sequence[KVGroupSpec],
        *,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        enable_host_prefix_cache: bool = False,
        max_chunk: int | None = None,
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not groups:
            raise ValueError("a hybrid KV cache needs at least one group")
        check_count("num_host_blocks", num_host_blocks)
        if enable_host_prefix_cache:
            raise ValueError("the hybrid KV cache has no host prefix-offload tier")
        if max_chunk is not None and (not isinstance(max_chunk, int) or max_chunk < 1):
            raise ValueError(f"max_chunk must be a positive int or None, got {max_chunk!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.groups = tuple(groups)
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_host_prefix_cache = False
        self.num_host_blocks = num_host_blocks
        self.max_chunk = max_chunk  # the most tokens one step schedules for a request
        self.counters = KVCacheCounters()
        self._pool = BlockPool(num_blocks, external_null_block=True, on_evict=self._on_evict)
        self._null: KVBlock = self._pool.null_block  # type: ignore[assignment]
        self._host = HostTier(num_host_blocks, step_pins=False)
        self._caches = [GroupPrefixCache(i) for i in range(len(self.groups))]
        self._tables: list[dict[str, BlockTable]] = [{} for _ in self.groups]
        self._hashes: dict[str, list[BlockHash]] = {}
        self._swapped: dict[str, HostGroups] = {}
        self._pending_copies: list[tuple[KVBlock, KVBlock]] = []
        self.num_window_freed_blocks = 0

    def _on_evict(self, block: KVBlock) -> None:
        """The pool hands out a free cached block again: its group forgets it."""
        node = block.cache_node
        self._caches[node[0]].evict(block)  # type: ignore[index]

    # ------------------------------------------------------------------ capacity

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable right now: free plus cached-but-evictable."""
        return self._pool.num_free_blocks

    @property
    def usage(self) -> float:
        """kv_usage: blocks referenced by live requests / total blocks."""
        return ratio(self.num_blocks - self._pool.num_free_blocks, self.num_blocks)

    @property
    def block_pool(self) -> BlockPool:
        return self._pool

    @property
    def host_tier(self) -> HostTier:
        return self._host

    @property
    def num_free_host_blocks(self) -> int:
        return self._host.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks of every group that ``num_tokens`` tokens hold at most."""
        check_count("num_tokens", num_tokens)
        return self.max_live_blocks(num_tokens)

    def max_live_blocks(self, num_tokens: int) -> int:
        """The most blocks, over all groups, a request of ``num_tokens`` tokens holds at once:
        all of them per full group, ``window_blocks`` per sliding group (chunks of at most
        ``max_chunk`` tokens; unknown: every block, as full attention)."""
        chunk = self.max_chunk if self.max_chunk is not None else num_tokens
        return hybrid_blocks_per_request(self.groups, self.block_size, num_tokens, chunk)

    def has_room_for(self, request: Request, reserve: int = 0) -> bool:
        """Whether ``request``'s known tokens (and ``reserve`` more) fit the free blocks now."""
        return self.num_free_blocks >= self.max_live_blocks(request.num_tokens) + reserve

    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's table (a full group when the model has one); empty if none."""
        table = self._tables[0].get(request_id)
        return [b.block_id for b in table.blocks] if table is not None else []

    def get_group_block_ids(self, request_id: str) -> list[list[int]] | None:
        """Every group's table, in group order (None if the request has none)."""
        if request_id not in self._tables[0]:
            return None
        return [[b.block_id for b in t[request_id].blocks] for t in self._tables]

    # ------------------------------------------------------------------ prefix hits

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.request_id, [])
        return extend_block_hashes(hashes, request, num_blocks, self.block_size)[:num_blocks]

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest prefix hit every group allows, capped at ``num_tokens - 1`` tokens by whole
        blocks: (group 0's hit block ids, hit tokens). Takes no references."""
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self._block_hashes(request, (request.num_tokens - 1) // self.block_size)
        h = longest_hit(self.groups, self._caches, hashes, self.block_size)
        blocks = hit_blocks(self.groups, self._caches, hashes, h, self.block_size, self._null)
        return [b.block_id for b in blocks[0]], h * self.block_size

    # ------------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[int] | None = None,
        num_new_computed_tokens: int = 0,
        reserve: int = 0,
    ) -> list[int] | None:
        """Grow every group's table to cover computed + hit + new tokens, all or nothing.

        Frees the blocks that left a sliding group's window first (by the tokens computed so
        far; kept even when the call returns None). Hits (``get_computed_blocks``) join only
        a first allocation. Returns the fresh block ids, or None with nothing else changed
        when they plus ``reserve`` do not fit the free blocks.
        """
        t0 = time.perf_counter()
        try:
            check_allocate_args(
                request.request_id, self._swapped, num_new_tokens, num_new_computed_tokens, reserve
            )
            return self._allocate(
                request, num_new_tokens, new_computed_blocks or [], num_new_computed_tokens, reserve
            )
        finally:
            self.counters.alloc_time_s += time.perf_counter() - t0
            self.counters.alloc_calls += 1

    def _resolve_hits(
        self, request: Request, first: bool, ids: list[int], num_hit_tokens: int
    ) -> list[list[KVBlock]]:
        """Each group's hit blocks for ``num_hit_tokens`` (ValueError if they are not what
        ``get_computed_blocks`` gave or the request cannot take hits)."""
        if not ids and not num_hit_tokens:
            return [[] for _ in self.groups]
        rid, bs = request.request_id, self.block_size
        if not first or request.num_computed_tokens:
            raise ValueError(
                f"new_computed_blocks given for request {rid!r}, which already has a block "
                "table or computed tokens: prefix hits join only on the first allocation"
            )
        if num_hit_tokens != len(ids) * bs or not self.enable_prefix_caching:
            raise ValueError(
                f"num_new_computed_tokens={num_hit_tokens} but {len(ids)} computed blocks "
                f"hold {len(ids) * bs} (prefix caching {self.enable_prefix_caching})"
            )
        hashes = self._block_hashes(request, len(ids))
        h = longest_hit(self.groups, self._caches, hashes, bs)
        if h < len(ids):
            raise ValueError(
                "new_computed_blocks are no longer in the prefix cache "
                "(call get_computed_blocks() right before allocate_slots())"
            )
        hits = hit_blocks(self.groups, self._caches, hashes, len(ids), bs, self._null)
        if [b.block_id for b in hits[0]] != list(ids):
            raise ValueError(f"new_computed_blocks {ids} are not the cached blocks of {rid!r}")
        return hits

    def _allocate(
        self,
        request: Request,
        num_new_tokens: int,
        ids: list[int],
        num_hit_tokens: int,
        reserve: int,
    ) -> list[int] | None:
        rid, bs, null = request.request_id, self.block_size, self._null
        first = rid not in self._tables[0]
        hits = self._resolve_hits(request, first, ids, num_hit_tokens)
        if not first:
            self.remove_skipped_blocks(request)
        num_computed = request.num_computed_tokens + num_hit_tokens
        num_total = num_computed + num_new_tokens
        num_table = -(-num_total // bs)
        needed, cows, num_revived = [], [], 0
        for g, tables in enumerate(self._tables):
            table = tables.get(rid)
            old = table.blocks if table is not None else hits[g]
            needed.append(max(0, num_table - len(old)))
            cow = []
            if num_new_tokens and table is not None:
                for i in range(num_computed // bs, len(old)):
                    b = old[i]
                    if b is not null and (b.ref_cnt != 1 or b.cache_node is not None):
                        cow.append(i)
            cows.append(cow)
            num_revived += sum(1 for b in hits[g] if b is not null and b.ref_cnt == 0)
        num_fresh = sum(needed) + sum(len(c) for c in cows)
        if num_fresh + reserve > self._pool.num_free_blocks - num_revived:
            return None
        # NOTE: every group's hits are revived before any allocation, so the allocation
        # cannot evict a later group's hit (vLLM's two-phase touch, issue #33775).
        for g_hits in hits:
            self._pool.touch(b for b in g_hits if b is not null)
        fresh = self._pool.allocate(num_fresh)
        rest = iter(fresh)
        for g, tables in enumerate(self._tables):
            table = tables.get(rid)
            if table is None:
                n_hit = len(hits[g])
                table = tables[rid] = BlockTable(request, list(hits[g]), n_hit, n_hit)
            if cows[g]:
                self._copy_on_write(table, cows[g], [next(rest) for _ in cows[g]], num_computed)
            table.blocks.extend(next(rest) for _ in range(needed[g]))
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, min(num_total, request.num_tokens) // bs)
            if first and request.num_preemptions == 0:
                self.counters.record_prefix_query(request.num_tokens, num_hit_tokens, 0)
        return [b.block_id for b in fresh]

    def _copy_on_write(
        self, table: BlockTable, indices: list[int], fresh: list[KVBlock], num_computed: int
    ) -> None:
        """Replace the not-writable blocks at ``indices``; copy the one holding computed
        tokens (its source keeps a reference until ``take_pending_copies``)."""
        released = []
        for i, new in zip(indices, fresh, strict=True):
            old = table.blocks[i]
            table.blocks[i] = new
            if i * self.block_size < num_computed:
                self._pending_copies.append((old, new))
                self.counters.cow_copies += 1
            else:
                released.append(old)
        self._pool.free(reversed(released))
        table.num_cached_blocks = min(table.num_cached_blocks, indices[0])
        table.num_full_checked = min(table.num_full_checked, indices[0])

    def _cache_full_blocks(self, request: Request, num_full: int) -> None:
        """Offer every group's newly full live blocks to its prefix cache (a key another
        block holds already leaves this one uncached)."""
        rid = request.request_id
        hashes: list[BlockHash] | None = None
        for cache, tables in zip(self._caches, self._tables, strict=True):
            table = tables[rid]
            if table.num_full_checked >= num_full:
                continue
            if hashes is None:
                hashes = self._block_hashes(request, num_full)
            for i in range(table.num_full_checked, num_full):
                block = table.blocks[i]
                if block is not self._null and block.cache_node is None:
                    cache.insert(hashes[i], block)
            table.num_full_checked = table.num_cached_blocks = num_full

    def remove_skipped_blocks(self, request: Request) -> list[int]:
        """Free every sliding group's blocks out of the window (by the tokens computed); their
        entries become the null block. Returns the freed ids."""
        rid, null, freed = request.request_id, self._null, []
        for spec, tables in zip(self.groups, self._tables, strict=True):
            table = tables.get(rid)
            if spec.window is None or table is None:
                continue
            skipped = out_of_window_blocks(
                request.num_computed_tokens, 0, spec.window, self.block_size
            )
            blocks = table.blocks
            gone = []
            for i in skipped:
                if i >= len(blocks):
                    break
                if blocks[i] is not null:
                    gone.append(blocks[i])
                    blocks[i] = null
            self._pool.free(reversed(gone))
            freed.extend(b.block_id for b in gone)
        self.num_window_freed_blocks += len(freed)
        return freed

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) pairs since the last call; releases the source pins."""
        if not self._pending_copies:
            return []
        pending, self._pending_copies = self._pending_copies, []
        self._pool.free(src for src, _ in pending)
        return [(src.block_id, dst.block_id) for src, dst in pending]

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """No host prefix tier: nothing to offload or load."""
        return [], []

    # ------------------------------------------------------------------ free / fork

    def free(self, request: Request) -> None:
        """Drop every group's device blocks (tail first) and its host blocks. No-op if unknown."""
        rid = request.request_id
        for tables in self._tables:
            table = tables.pop(rid, None)
            if table is not None:
                self._pool.free(b for b in reversed(table.blocks) if b is not self._null)
        host = self._swapped.pop(rid, None)
        if host is not None:
            self._host.release(h for _, pairs in host for _, h in reversed(pairs))
        self._hashes.pop(rid, None)

    def forget_unwritten(
        self, request: Request, num_written_tokens: int, block_ids: list[int] | None = None
    ) -> int:
        """Take every group's blocks from token ``num_written_tokens`` on out of the prefix
        cache (a failed step's); returns how many. ``block_ids``: group 0's step table, for a
        request with no device table."""
        first, n = num_written_tokens // self.block_size, 0
        rid = request.request_id
        for cache, tables in zip(self._caches, self._tables, strict=True):
            table = tables.get(rid)
            if table is None:
                if cache.group_index != 0:
                    continue
                blocks = [self._pool.blocks[i] for i in (block_ids or [])[first:] if i >= 0]
            else:
                blocks = table.blocks[first:]
                table.num_cached_blocks = min(table.num_cached_blocks, first)
            for b in blocks:
                if b.cache_node is not None:
                    cache.evict(b)
                    n += 1
        return n

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` a share of every group's table of the parent (ref counts +1)."""
        pid, cid = parent.request_id, child.request_id
        if pid not in self._tables[0]:
            raise ValueError(f"fork: parent {pid!r} has no device block table")
        if cid == pid or cid in self._tables[0] or cid in self._swapped:
            raise ValueError(f"fork: child {cid!r} already has blocks")
        num_shared = min(child.num_tokens, parent.num_computed_tokens)
        if child.token_ids_slice(0, num_shared) != parent.token_ids_slice(0, num_shared):
            raise ValueError(
                f"fork: child {cid!r}'s tokens differ from parent {pid!r}'s computed tokens"
            )
        for tables in self._tables:
            ptable = tables[pid]
            live = [b for b in ptable.blocks if b is not self._null]
            self._pool.touch(live)
            n = min(ptable.num_cached_blocks, num_shared // self.block_size)
            tables[cid] = BlockTable(child, list(ptable.blocks), n, n)
            self.counters.fork_shared_blocks += len(live)

    # ------------------------------------------------------------------ cache admin, figures

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Only when no block is held; returns whether it did."""
        if self.num_free_blocks != self._pool.num_usable_blocks:
            return False
        for cache in self._caches:
            cache.clear()
        return True

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` naming the first broken invariant (``hybrid_integrity``)."""
        check_hybrid(
            self.groups,
            self._pool,
            self._tables,
            self._caches,
            [src for src, _ in self._pending_copies],
            self.block_size,
            lambda r, n: extend_block_hashes([], r, n, self.block_size),
        )
        if any(rid in self._tables[0] for rid in self._swapped):
            raise IntegrityError("a request has both a device and a host block table")
        held = (h.host_block_id for rec in self._swapped.values() for _, p in rec for _, h in p)
        self._host.check_integrity(held)
