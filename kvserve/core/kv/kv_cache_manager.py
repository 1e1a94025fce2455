"""KV cache manager: per-request block tables over a BlockPool and a prefix cache.

Token p lives in block ``table[p // block_size]`` at offset ``p % block_size``. The manager
decides which physical block each entry is; the runtime moves bytes as told by (src, dst)
lists (copy-on-write copies, swap plans). Life of a request:

1. ``get_computed_blocks``: longest cached block-aligned prefix, capped so one token is
   left to compute. *Choice*: the cap drops a whole block. A block-aligned prompt that is
   fully cached gets all blocks but its last; that block is recomputed into a fresh block
   (never written in place), so a prefix hit never copies. Cost: at most ``block_size``
   recomputed tokens, once per admission.
2. ``allocate_slots`` (all-or-nothing): prefix hits join the table, fresh blocks cover the
   new tokens, and every *existing* block the step would write that is not writable is
   replaced (copy-on-write). Full blocks are then offered to the prefix cache.
3. ``remove_skipped_blocks``: blocks no later query reads are freed; their entries become
   the pool's null block (a no-op here; windowed attention overrides ``_skipped_blocks``).
4. ``fork`` shares a whole table; ``swap_out`` / ``swap_in`` move it to and from the host
   tier; ``free`` drops it (tail first, so a request's tail is evicted before its head).

Collaborators: ``block_tables.BlockTableManager`` (tables, copy-on-write, fork, skipped
blocks, free), ``host_prefix.HostPrefixTier`` (offload on eviction, host hits reported as
``-1 - host id``), ``swap_space.SwapSpace``, ``slot_plan`` (an allocation's needs, decided
first), ``prefix_hits``, ``integrity`` (the invariants ``check_integrity`` raises
``IntegrityError`` for), ``metrics``. Variants (``window.py``, ``contiguous.py``) change
behaviour only through protected hooks (``_allocate_slots``, ``_swap_out_blocks``,
``_blocks_for_swap_in``, ``prefix_caching_conflict``, the layer below's).

Scheduler rules these rely on (CONTRACTS.md): a step computes the blocks allocated for it,
so a request in a step is not freed, swapped out or forked from before it has run;
``remove_skipped_blocks`` and ``take_pending_copies/swaps()`` run once a step, after the
last allocation; the runner does swap-out, swap-in, copies, then the forward pass.
"""

from __future__ import annotations

import time
from typing import ClassVar

from kvserve.core.errors import IntegrityError
from kvserve.core.kv import integrity
from kvserve.core.kv.block_pool import KVBlock
from kvserve.core.kv.block_tables import BlockTableManager, check_allocate_args, check_count
from kvserve.core.kv.host_prefix import HostPrefixTier
from kvserve.core.kv.host_tier import HostBlock, HostTier
from kvserve.core.kv.kv_cache_config import KVCacheConfig, check_cache_options
from kvserve.core.kv.metrics import capacity_figures
from kvserve.core.kv.prefix_cache import PrefixCache, RadixPrefixCache
from kvserve.core.kv.prefix_hits import (
    cache_full_blocks,
    forget_blocks,
    host_block_ref,
    match_prefix,
)
from kvserve.core.kv.slot_plan import plan_slots, swap_in_blocks
from kvserve.core.kv.swap_space import SwapSpace
from kvserve.core.kv.tables import BlockTable
from kvserve.request import Request

__all__ = ["KVCacheManager", "host_block_ref"]


class KVCacheManager(BlockTableManager):
    """Prefix caching, the host tiers and swap over block tables. See the module docstring."""

    # Why a variant cannot cache prefixes (None: it can); enable_prefix_caching=True is then
    # a ValueError quoting it.
    prefix_caching_conflict: ClassVar[str | None] = None

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        prefix_cache: PrefixCache | None = None,
        enable_host_prefix_cache: bool = False,
    ) -> None:
        super().__init__(num_blocks, block_size, on_evict=self._on_device_evict)
        check_count("num_host_blocks", num_host_blocks)
        check_cache_options(
            type(self).__name__,
            self.prefix_caching_conflict,
            enable_prefix_caching=enable_prefix_caching,
            enable_host_prefix_cache=enable_host_prefix_cache,
            num_host_blocks=num_host_blocks,
        )
        self.num_host_blocks = num_host_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_host_prefix_cache = enable_host_prefix_cache
        self._cache: PrefixCache = prefix_cache or RadixPrefixCache(block_size)
        if self._cache.block_size != block_size:
            raise ValueError("prefix_cache.block_size must equal block_size")
        self._host_prefix = HostPrefixTier(
            num_host_blocks,
            enabled=enable_host_prefix_cache,
            cache=self._cache,
            counters=self.counters,
        )
        self._host = self._host_prefix.tier  # host block ids, shared with swap preemption
        self._swapped = SwapSpace(self._host, self.counters)

    @classmethod
    def from_config(cls, config: KVCacheConfig) -> KVCacheManager:
        """Build from ``config`` (``create_kv_cache_manager`` calls this on the chosen class)."""
        return cls(
            config.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            num_host_blocks=config.num_host_blocks,
            enable_host_prefix_cache=config.enable_host_prefix_cache,
        )

    def _on_device_evict(self, block: KVBlock) -> None:
        """The pool hands out cached ``block`` again: the host prefix tier keeps or drops it."""
        self._host_prefix.on_device_evict(block)

    # ------------------------------------------------------------------ capacity

    @property
    def num_free_host_blocks(self) -> int:
        """Host blocks a swap-out can have now: free plus evictable offloaded prefix blocks."""
        return self._host.num_free_blocks

    @property
    def host_tier(self) -> HostTier:
        return self._host

    @property
    def prefix_cache(self) -> PrefixCache:
        return self._cache

    def num_swapped_blocks(self, request: Request) -> int:
        """Blocks the request holds in the host tier (0 unless swapped out)."""
        return self._swapped.num_blocks(request.request_id)

    # ------------------------------------------------------------------ prefix hits

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached block-aligned prefix of the request's tokens under its salt.

        Capped at ``num_tokens - 1`` tokens by dropping whole blocks (see the module
        docstring), so the returned token count is always ``len(block ids) * block_size``.
        With the host offload tier, host-resident blocks follow the device ones, reported
        as ``host_block_ref(host id)`` (negative); ``allocate_slots`` loads them.
        Takes no references and records no stats.
        """
        if not self.enable_prefix_caching:
            return [], 0
        blocks = match_prefix(self._cache, request, (request.num_tokens - 1) // self.block_size)
        ids = [
            host_block_ref(b.host_block_id) if isinstance(b, HostBlock) else b.block_id
            for b in blocks
        ]
        return ids, len(blocks) * self.block_size

    # ------------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[int] | None = None,
        num_new_computed_tokens: int = 0,
        reserve: int = 0,
    ) -> list[int] | None:
        """Grow the request's table to cover computed + new computed + new tokens.

        All-or-nothing: returns the ids of the blocks allocated by this call (appended or
        copy-on-write replacements), or None with nothing changed when fewer than
        ``needed + reserve`` blocks can be had. ``new_computed_blocks`` (from
        ``get_computed_blocks``) are only accepted on the request's first allocation,
        which also records the prefix-cache query (``num_tokens``) and hit. Host-resident
        hits take a fresh device block each (counted in needed) and a load is planned.
        """
        t0 = time.perf_counter()  # NOTE: try/finally, not a context manager: a hot path
        try:
            # NOTE: checked here for every allocator (variants override _allocate_slots).
            check_allocate_args(
                request.request_id, self._swapped, num_new_tokens, num_new_computed_tokens, reserve
            )
            return self._allocate_slots(
                request, num_new_tokens, new_computed_blocks or [], num_new_computed_tokens, reserve
            )
        finally:
            self.counters.alloc_time_s += time.perf_counter() - t0
            self.counters.alloc_calls += 1

    def _allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_ids: list[int],
        num_new_computed_tokens: int,
        reserve: int,
    ) -> list[int] | None:
        """The allocation policy (hook): paged, block by block, with prefix hits and CoW.

        The request's tokens after this call, left to right::

            |  computed  | device hits | host hits |     new      |
            |<- table -->|<- num_new_computed ---->|<- num_new -->|
            0            ^ request.num_computed_tokens           ^ num_total
                                                   ^ num_computed

        - computed: already in the table (``num_computed_tokens``; 0 when there are hits,
          which join only a request's first allocation).
        - device hits: cached device blocks (``computed``): revived (``touch``), no copy.
        - host hits: host-resident cached blocks: each takes a fresh device block and a
          host -> device load is planned (``HostPrefixTier.load``).
        - new: ``num_new_tokens`` this step computes; fresh blocks past the table's end,
          and existing blocks in this range that are not writable are replaced
          (copy-on-write, a copy only for a block already holding computed tokens).

        Fresh blocks = host hits + new blocks + copy-on-write replacements; all of them
        plus ``reserve`` must fit in the free blocks (minus revived hits), else None.
        ``slot_plan.plan_slots`` decides all this before anything changes; this applies it.
        """
        pool = self.block_pool
        table = self._table(request.request_id)
        bs = self.block_size
        plan = plan_slots(
            request,
            table,
            computed_ids,
            num_new_computed_tokens,
            num_new_tokens,
            block_size=bs,
            pool=pool,
            host_tier=self._host,
        )
        if not plan.fits(pool.num_free_blocks, reserve):
            return None
        computed, host_hits, num_needed = plan.computed, plan.host_hits, plan.num_needed
        num_loads = len(host_hits)
        if computed:
            # NOTE: revive the prefix hits first, or the allocation below could evict them.
            pool.touch(computed)
        if host_hits:
            self._host_prefix.claim(host_hits)
        fresh = pool.allocate(plan.num_fresh) if plan.num_fresh else []
        if host_hits:
            self._host_prefix.load(host_hits, fresh[:num_loads])
            computed = computed + fresh[:num_loads]
        first = table is None
        if table is None:
            table = self._new_table(request, computed, plan.num_hits)
        if plan.cow_indices:
            cow_fresh = fresh[num_loads + num_needed :]
            self._copy_on_write(table, plan.cow_indices, cow_fresh, plan.num_computed)
        if num_needed:
            table.blocks.extend(fresh[num_loads : num_loads + num_needed])
        if self.enable_prefix_caching:
            num_full = min(plan.num_total, request.num_tokens) // bs
            self._offer_full_blocks(table, num_full)
            # NOTE: a request's first admission only: one preempted by recompute looks its
            # tokens up again, and counting that made hits exceed the prompt tokens.
            if first and request.num_preemptions == 0:
                hits = num_new_computed_tokens
                self.counters.record_prefix_query(request.num_tokens, hits, num_loads * bs)
        return [b.block_id for b in fresh]

    def _offer_full_blocks(self, table: BlockTable, num_full: int) -> None:
        """``cache_full_blocks``, counting the duplicates swapped (``dedup_blocks``)."""
        args = (self.block_size, self.block_pool, self._all_tables(), self._swapped.restoring)
        self.counters.dedup_blocks += cache_full_blocks(self._cache, table, num_full, *args)

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host prefix tier's (offloads, loads) since the last call, for the step's
        ``blocks_to_swap_out`` / ``blocks_to_swap_in``; clears and ends the step's host pins.
        Call once per step, after the last allocation (with ``take_pending_copies``)."""
        self._swapped.restoring.clear()
        return self._host_prefix.take_plans()

    # ------------------------------------------------------------------ free / fork

    def free(self, request: Request) -> None:
        """Drop the request's device blocks (tail first) and host blocks. No-op if unknown."""
        super().free(request)
        self._swapped.free(request.request_id)

    def forget_unwritten(
        self, request: Request, num_written_tokens: int, block_ids: list[int] | None = None
    ) -> int:
        """Take the request's blocks from token ``num_written_tokens`` on out of the prefix cache.

        For a request whose step failed: its new blocks were offered to the prefix cache when
        allocated, but their KV was never (or wrongly) written. Call before ``free``; returns
        the number forgotten. ``block_ids`` (the step's table) name the blocks of a request
        with no device table (async scheduling: preempted since its step was scheduled).
        """
        table, first = self._table(request.request_id), num_written_tokens // self.block_size
        ids = [i for i in (block_ids or [])[first:] if i >= 0]  # not the null block
        blocks = table.blocks[first:] if table else [self.block_pool.blocks[i] for i in ids]
        return forget_blocks(self._cache, self._host, blocks, self._all_tables())

    def fork(self, parent: Request, child: Request) -> None:
        """As ``BlockTableManager.fork``; a swapped-out child id is taken too."""
        if child.request_id in self._swapped:
            raise ValueError(f"fork: child {child.request_id!r} already has blocks")
        super().fork(parent, child)

    # ------------------------------------------------------------------ swap

    def _swap_out_blocks(self, table: BlockTable) -> list[KVBlock]:
        """The blocks ``swap_out`` copies to the host tier, in table order (hook): all."""
        return table.blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host tier: (device, host) pairs, table order.

        Drops the device references (as ``free`` does). Returns None, changing nothing, if
        the host tier has fewer free blocks than it needs, or if the table has skipped
        (null) entries (preempt such a request by recompute).
        """
        rid = request.request_id
        table = self._table(rid)
        if table is None:
            raise ValueError(f"swap_out: request {rid!r} has no device block table")
        if self.block_pool.null_block in table.blocks:
            return None
        if self._copies_into(table.blocks):
            raise ValueError(f"swap_out: request {rid!r} has a copy-on-write pending in this step")
        if self._host_prefix.loads_into(table.blocks):
            raise ValueError(f"swap_out: request {rid!r} has a host load pending in this step")
        pairs = self._swapped.store(request, self._swap_out_blocks(table))
        if pairs is None:
            return None
        self._pop_table(rid)
        self.block_pool.free(reversed(table.blocks))
        return pairs

    def swap_in(self, request: Request, reserve: int = 0) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request back: (host, device) pairs to copy.

        Leading full computed blocks still in the prefix cache are reused instead of
        copied. Returns None, changing nothing, if fewer than ``needed + reserve`` blocks
        can be had.
        """
        with self.counters.timing_alloc():
            return self._swap_in(request, reserve)

    def _swap_in(self, request: Request, reserve: int) -> list[tuple[int, int]] | None:
        """Give the swapped-out request a device table again; plan the copies.

        The request's host blocks and its new table, left to right::

            host:   | h0 ...          h_r-1 | h_r ...                      h_n-1 |
            device: | reused (device hits)  | fresh (copied host -> device) | (more) |
                    0                       ^ num_reused                   ^ n = len(host)

        - reused: leading full computed blocks still cached on the device (a prefix hit),
          so their host copies are not read; found by ``_blocks_for_swap_in``.
        - fresh: a device block per remaining host block; (host, device) pairs are the
          plan, and the host blocks stay pinned until the step's plans are taken.
        - a variant may give the table more blocks than the host held (the contiguous
          allocator's reservation): they hold no tokens yet.
        """
        check_count("reserve", reserve)
        rid = request.request_id
        hosts = self._swapped.host_blocks(rid)
        if hosts is None:
            raise ValueError(f"swap_in: request {rid!r} is not swapped out")
        got = self._blocks_for_swap_in(request, len(hosts), reserve)
        if got is None:
            return None
        blocks, num_reused = got
        pairs = self._swapped.restore(rid, blocks, num_reused)
        table = self._new_table(request, blocks, num_reused)
        if self.enable_prefix_caching:
            self._offer_full_blocks(table, request.num_computed_tokens // self.block_size)
        return pairs

    def _blocks_for_swap_in(
        self, request: Request, num_host_blocks: int, reserve: int
    ) -> tuple[list[KVBlock], int] | None:
        """The swapped-in table's blocks and how many lead as reused prefix hits (hook).

        Held (touched / allocated) on return; None, holding nothing, if fewer than
        ``needed + reserve`` blocks can be had.
        """
        cache = self._cache if self.enable_prefix_caching else None
        return swap_in_blocks(
            request,
            num_host_blocks,
            reserve,
            pool=self.block_pool,
            cache=cache,
            block_size=self.block_size,
        )

    # ------------------------------------------------------------------ cache admin

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Only when no block is held; returns whether it did."""
        if self.num_free_blocks != self.block_pool.num_usable_blocks:
            return False
        self._cache.clear()
        self._host_prefix.clear()
        return True

    # ------------------------------------------------------------------ figures

    def snapshot(self) -> dict[str, float | int]:
        """Every capacity figure by name (see CONTRACTS.md); O(total table length).

        Utilization counts live blocks only (skipped null entries hold no tokens).
        """
        return capacity_figures(self, self._utilization(), bool(self._all_tables()))

    def dump_state(self) -> dict[str, object]:
        """Everything that defines the manager's state, as plain comparable data.

        Tests compare it before and after an operation that must change nothing. Timing
        counters (alloc_time_s, alloc_calls) are left out: they measure, they are not state.
        """
        figures = self.snapshot()
        del figures["alloc_time_s"], figures["alloc_calls"]
        return {
            **self._dump_tables(),
            "host_tables": self._swapped.dump(),
            **self._host_prefix.dump(),
            "prefix_cache": self._cache.dump(),
            "figures": figures,
        }

    # ------------------------------------------------------------------ integrity

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` naming the first broken invariant (module docstring).

        Explicit raises, not ``assert``: the checks run under ``python -O`` too.
        """
        cache = self._cache
        cache.check_integrity()
        if any(self._table(rid) is not None for rid in self._swapped.request_ids()):
            raise IntegrityError("a request has both a device and a host block table")
        self._check_tables(cache)
        pool = self.block_pool
        num_host_cached = self._host.num_cached_blocks
        integrity.check_cached_counts(pool, num_host_cached, cache, self.enable_prefix_caching)
        integrity.check_eviction_order(pool, cache)
        self._host_prefix.check_integrity(self._swapped.held_ids(), self.num_blocks)
