"""KV cache manager: per-request block tables over a BlockPool and a prefix cache.

Token p of a request lives in block ``table[p // block_size]`` at offset
``p % block_size``. The manager decides which physical block each table entry is; the
runtime moves bytes as told by (src, dst) lists: copy-on-write copies and swap plans.

Life of a request:

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

Layers and collaborators: ``block_tables.BlockTableManager`` (the layer below: tables over
the pool, copy-on-write, fork, skipped blocks, free), ``host_prefix.HostPrefixTier`` (the
host prefix tier: offload on eviction, loads of host-resident hits, reported as
``-1 - host id``), ``swap_space.SwapSpace`` (swapped-out requests' host tables),
``prefix_hits`` and ``integrity`` (functions). Variants (``core/window.py``,
``core/contiguous.py``; ``create_kv_cache_manager`` picks one) change behaviour only through
protected hooks (those of the layer below, plus ``_allocate_slots``, ``_swap_out_blocks``,
``_blocks_for_swap_in`` and ``prefix_caching_conflict`` here), never by reaching into
either layer's state.

Invariants (``check_integrity`` raises ``IntegrityError`` naming the first broken one): listed
in ``core/integrity.py``, next to the checks; the host tier's in ``core/host_prefix.py``.

Scheduler rules these rely on (documented in CONTRACTS.md): blocks allocated for a step are
computed by that step, so a request scheduled in a step is not freed, swapped out or
forked from before the step has run; ``remove_skipped_blocks``, ``take_pending_copies()``
and ``take_pending_swaps()`` are called once per step, after the last allocation, and the
runner executes swap-out, swap-in, copies, then the forward pass.
"""

from __future__ import annotations

import time
from typing import ClassVar

from kvserve.core import integrity
from kvserve.core.block_pool import KVBlock
from kvserve.core.block_tables import BlockTableManager, check_count
from kvserve.core.errors import IntegrityError
from kvserve.core.host_prefix import HostPrefixTier
from kvserve.core.host_tier import HostBlock, HostTier
from kvserve.core.kv_cache_config import KVCacheConfig
from kvserve.core.metrics import ratio
from kvserve.core.prefix_cache import CacheEntry, PrefixCache, RadixPrefixCache
from kvserve.core.prefix_hits import (
    cache_full_blocks,
    device_prefix,
    host_block_ref,
    match_prefix,
    resolve_prefix_hits,
)
from kvserve.core.swap_space import SwapSpace
from kvserve.core.tables import BlockTable
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
        if enable_prefix_caching and self.prefix_caching_conflict is not None:
            raise ValueError(
                f"{type(self).__name__} needs enable_prefix_caching=False: "
                f"{self.prefix_caching_conflict}"
            )
        if enable_host_prefix_cache and not enable_prefix_caching:
            raise ValueError("enable_host_prefix_cache needs enable_prefix_caching")
        if enable_host_prefix_cache and num_host_blocks == 0:
            raise ValueError(
                "enable_host_prefix_cache needs a host tier: num_host_blocks (swap_space) is 0"
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
        self._swapped = SwapSpace(self._host)

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
            if num_new_tokens < 0 or num_new_computed_tokens < 0 or reserve < 0:
                raise ValueError(
                    f"allocate_slots: num_new_tokens={num_new_tokens}, num_new_computed_tokens="
                    f"{num_new_computed_tokens} and reserve={reserve} must all be >= 0"
                )
            if request.request_id in self._swapped:
                raise ValueError(
                    f"request {request.request_id!r} is swapped out: "
                    "swap_in() before allocate_slots()"
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
        """
        pool = self.block_pool
        table = self._table(request.request_id)
        bs = self.block_size
        computed, host_hits = resolve_prefix_hits(
            request,
            table is not None,
            computed_ids,
            num_new_computed_tokens,
            block_size=bs,
            pool=pool,
            host_tier=self._host,
        )
        num_hits = len(computed) + len(host_hits)

        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total = num_computed + num_new_tokens
        old_blocks = table.blocks if table is not None else []
        num_needed = max(0, -(-num_total // bs) - len(old_blocks) - num_hits)
        # Copy-on-write: every existing block from the first one this step writes to the
        # end of the table must be writable (ref 1, not cached), else it is replaced.
        cow_indices: list[int] = []
        if num_new_tokens:
            for i in range(num_computed // bs, len(old_blocks)):
                block = old_blocks[i]
                if block.ref_cnt != 1 or block.cache_node is not None:
                    cow_indices.append(i)
        num_revived = sum(1 for b in computed if b.ref_cnt == 0) if computed else 0
        num_loads = len(host_hits)
        num_fresh = num_loads + num_needed + len(cow_indices)
        if num_fresh + reserve > pool.num_free_blocks - num_revived:
            return None

        if computed:
            # NOTE: revive the prefix hits first, or the allocation below could evict them.
            pool.touch(computed)
        if host_hits:
            self._host_prefix.claim(host_hits)
        fresh = pool.allocate(num_fresh) if num_fresh else []
        if host_hits:
            self._host_prefix.load(host_hits, fresh[:num_loads])
            computed = computed + fresh[:num_loads]
        first = table is None
        if table is None:
            table = self._new_table(request, computed, num_hits)
        if cow_indices:
            self._copy_on_write(table, cow_indices, fresh[num_loads + num_needed :], num_computed)
        if num_needed:
            table.blocks.extend(fresh[num_loads : num_loads + num_needed])
        if self.enable_prefix_caching:
            cache_full_blocks(self._cache, table, min(num_total, request.num_tokens) // bs, bs)
            if first:
                c = self.counters
                c.prefix_cache_queries += request.num_tokens
                c.prefix_cache_hits += num_new_computed_tokens
                c.host_hit_tokens += num_loads * bs
                c.device_hit_tokens += num_new_computed_tokens - num_loads * bs
        return [b.block_id for b in fresh]

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host prefix tier's (offloads, loads) since the last call, for the step's
        ``blocks_to_swap_out`` / ``blocks_to_swap_in``; clears and ends the step's host pins.
        Call once per step, after the last allocation (with ``take_pending_copies``)."""
        return self._host_prefix.take_plans()

    # ------------------------------------------------------------------ free / fork

    def free(self, request: Request) -> None:
        """Drop the request's device blocks (tail first) and host blocks. No-op if unknown."""
        super().free(request)
        self._swapped.free(request.request_id)

    def forget_unwritten(self, request: Request, num_written_tokens: int) -> int:
        """Take the request's blocks from token ``num_written_tokens`` on out of the prefix cache.

        For a request whose step failed: its new blocks were offered to the prefix cache when
        they were allocated, but their KV was never (or wrongly) written, so no later request
        may match them. Call before ``free``. Returns the number of blocks forgotten.
        """
        table = self._table(request.request_id)
        if table is None:
            return 0
        first = num_written_tokens // self.block_size
        removed: list[CacheEntry] = []
        for block in table.blocks[first:]:
            if block.cache_node is not None:
                # NOTE: the rest of its path goes too: descendants extend unwritten KV.
                removed = self._cache.remove_subtree(block)
                break
        hosts = [b for b in removed if isinstance(b, HostBlock)]
        for host in hosts:
            self._host.uncache(host)
        self._host.release(hosts)
        if removed:
            # Tables that shared a forgotten block now end their cached run before it.
            for t in self._all_tables():
                n = 0
                while n < t.num_cached_blocks and t.blocks[n].cache_node is not None:
                    n += 1
                t.num_cached_blocks = n
                t.num_full_checked = min(t.num_full_checked, n)
        return len(removed)

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
        moved = self._swap_out_blocks(table)
        hosts = self._swapped.store(request, len(moved))
        if hosts is None:
            return None
        self._pop_table(rid)
        self.block_pool.free(reversed(table.blocks))
        self.counters.swap_out_blocks += len(moved)
        return [(b.block_id, h.host_block_id) for b, h in zip(moved, hosts, strict=True)]

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
        self._swapped.restore(rid, num_reused)
        table = self._new_table(request, blocks, num_reused)
        if self.enable_prefix_caching:
            num_full = request.num_computed_tokens // self.block_size
            cache_full_blocks(self._cache, table, num_full, self.block_size)
        copied = blocks[num_reused : len(hosts)]
        self.counters.swap_in_blocks += len(copied)
        return [
            (h.host_block_id, b.block_id) for h, b in zip(hosts[num_reused:], copied, strict=True)
        ]

    def _blocks_for_swap_in(
        self, request: Request, num_host_blocks: int, reserve: int
    ) -> tuple[list[KVBlock], int] | None:
        """The swapped-in table's blocks and how many lead as reused prefix hits (hook).

        Held (touched / allocated) on return; None, holding nothing, if fewer than
        ``needed + reserve`` blocks can be had.
        """
        reused: list[KVBlock] = []
        if self.enable_prefix_caching:
            max_blocks = min(num_host_blocks, request.num_computed_tokens // self.block_size)
            # NOTE: device hits only: the request's own host copy beats a host-resident hit.
            reused = device_prefix(match_prefix(self._cache, request, max_blocks))
        num_needed = num_host_blocks - len(reused)
        num_revived = sum(1 for b in reused if b.ref_cnt == 0)
        pool = self.block_pool
        if num_needed + reserve > pool.num_free_blocks - num_revived:
            return None
        pool.touch(reused)
        return reused + pool.allocate(num_needed), len(reused)

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
        util = self._utilization()
        c = self.counters
        return {
            "num_kv_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_free_blocks": self.num_free_blocks,
            "kv_usage": self.usage,
            "kv_utilization": util,
            # NOTE: 0 when idle (nothing allocated), 1 when blocks are allocated but empty.
            "fragmentation": 1.0 - util if self._all_tables() else 0.0,
            "prefix_hit_rate": ratio(c.prefix_cache_hits, c.prefix_cache_queries),
            "prefix_cache_evictions": self.block_pool.num_evictions,
            "num_host_blocks": self.num_host_blocks,
            "num_free_host_blocks": self.num_free_host_blocks,
            "host_cache_blocks": self._host.num_cached_blocks,
            **c.as_dict(),  # every counter by its name (core/metrics.py)
        }

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
        num_cached = sum(b.cache_node is not None for b in pool.blocks)
        num_host_cached = self._host.num_cached_blocks
        if num_cached + num_host_cached != cache.num_cached_blocks:
            raise IntegrityError(
                f"{num_cached} pool blocks and {num_host_cached} host blocks are marked "
                f"cached, the prefix cache maps {cache.num_cached_blocks}"
            )
        if not self.enable_prefix_caching and num_cached:
            raise IntegrityError("caching is off but blocks cached")
        integrity.check_eviction_order(pool, cache)
        self._host_prefix.check_integrity(self._swapped.held_ids(), self.num_blocks)
