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
3. ``fork`` shares a whole table; ``swap_out`` / ``swap_in`` move it to and from the host
   tier; ``free`` drops it (tail first, so a request's tail is evicted before its head).

Host offload tier (``enable_host_prefix_cache=True``; ``core/host_tier.py``): the host blocks
serve swap preemption *and* a second level of the prefix cache. When the pool hands out a
free cached block again, the manager copies it to a host block (free, or the oldest
unpinned offloaded one, itself evicted) and the tree keeps the path, now host-resident; with
no host block to be had, the block is dropped with its (host-resident) subtree. A later
``get_computed_blocks`` matches host-resident blocks too (reported as ids ``-1 - host id``);
``allocate_slots`` gives each a fresh device block and plans a host->device load. Offload
(device, host) and load (host, device) pairs are handed over by ``take_pending_swaps()``;
the scheduler appends them to the step's ``blocks_to_swap_out`` / ``blocks_to_swap_in``, so
the runner copies an evicted block out before this step's forward pass overwrites it, and
loads before the forward pass reads. Swapped-out requests' host blocks are never evicted.

Invariants (``check_integrity``):

- A block's ref count = block tables holding it + pending copy-on-write sources pinned
  until ``take_pending_copies()``. Ref 0 <=> in the pool's free list.
- Writable = ref 1 and not cached. Cached blocks and shared blocks are never written: a
  write goes to a fresh block, with a copy when the block already holds computed tokens.
- Each table starts with a run of cached blocks that is a root path of the prefix cache,
  and holds no cached block after it; its first ``num_cached_blocks`` are exactly what the
  cache matches for the request's own tokens and salt.
- Ancestor closure: a held cached block's parent is held; a free cached block comes before
  its free parent in the free list, so the pool only ever evicts device leaves.
- Residency: a cached device block's cached parent is a device block (host blocks have only
  host children), so a match is device blocks then host blocks. A cached host block's
  host parent comes after it in the host LRU, so the host tier only evicts leaves.
- Step plans: an offload destination or load source host block is pinned (never handed out
  again) until ``take_pending_swaps()``; a load's device destination is held and cached;
  a request holding a block loaded in this step is not swapped out before the step runs.

Scheduler rules these rely on (documented in CONTRACTS.md): blocks allocated for a step are
computed by that step, so a request scheduled in a step is not freed, swapped out or
forked from before the step has run; ``take_pending_copies()`` and ``take_pending_swaps()``
are called once per step, after the last allocation, and the runner executes swap-out,
swap-in, copies, then the forward pass.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from kvserve.core.block_pool import BlockPool, KVBlock
from kvserve.core.host_tier import HostBlock, HostTier
from kvserve.core.metrics import KVCacheCounters, kv_utilization, ratio
from kvserve.core.prefix_cache import CacheEntry, PrefixCache, RadixPrefixCache, describe
from kvserve.request import Request


@dataclass(slots=True, eq=False)
class _Table:
    """The device block table of one request."""

    request: Request
    blocks: list[KVBlock]
    num_cached_blocks: int = 0  # blocks[:n] are this request's own path in the prefix cache
    num_full_checked: int = 0  # full blocks already offered to the prefix cache


@dataclass(slots=True, eq=False)
class _HostTable:
    """A swapped-out request: its blocks live in the host tier, in table order."""

    request: Request
    host_blocks: list[HostBlock]


def _check_count(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def host_block_ref(host_block_id: int) -> int:
    """How ``get_computed_blocks`` reports a host-resident prefix block: ``-1 - host id``."""
    return -1 - host_block_id


def _token_ids(request: Request) -> list[int]:
    """Prompt + output without a copy when there is no output yet."""
    return request.all_token_ids if request.output_token_ids else request.prompt_token_ids


class KVCacheManager:
    """Block tables, prefix caching, copy-on-write and swap plans. See the module docstring."""

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
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        _check_count("num_host_blocks", num_host_blocks)
        if enable_host_prefix_cache and not enable_prefix_caching:
            raise ValueError("enable_host_prefix_cache needs enable_prefix_caching")
        if enable_host_prefix_cache and num_host_blocks == 0:
            raise ValueError(
                "enable_host_prefix_cache needs a host tier: num_host_blocks (swap_space) is 0"
            )
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_host_prefix_cache = enable_host_prefix_cache
        self._cache: PrefixCache = prefix_cache or RadixPrefixCache(block_size)
        if self._cache.block_size != block_size:
            raise ValueError("prefix_cache.block_size must equal block_size")
        self._pool = BlockPool(num_blocks, on_evict=self._on_device_evict)
        self.num_blocks = num_blocks
        self._host = HostTier(
            num_host_blocks, step_pins=enable_host_prefix_cache, on_evict=self._on_host_evict
        )
        self._tables: dict[str, _Table] = {}
        self._host_tables: dict[str, _HostTable] = {}
        # Copy-on-write (src, dst); src keeps the reference its table dropped until
        # take_pending_copies(), so nothing can overwrite it before the runner copies it.
        self._pending_copies: list[tuple[KVBlock, KVBlock]] = []
        # Offload tier plans of this step: (device id, host) and (host, device).
        self._pending_offloads: list[tuple[int, HostBlock]] = []
        self._pending_loads: list[tuple[HostBlock, KVBlock]] = []
        self.counters = KVCacheCounters()

    # ------------------------------------------------------------------ capacity

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable right now: free plus cached-but-evictable."""
        return self._pool.num_free_blocks

    @property
    def num_free_host_blocks(self) -> int:
        """Host blocks a swap-out can have now: free plus evictable offloaded prefix blocks."""
        return self._host.num_free_blocks

    @property
    def host_tier(self) -> HostTier:
        return self._host

    @property
    def usage(self) -> float:
        """kv_usage: blocks referenced by live requests / total blocks."""
        return ratio(self.num_blocks - self._pool.num_free_blocks, self.num_blocks)

    @property
    def prefix_cache(self) -> PrefixCache:
        return self._cache

    @property
    def block_pool(self) -> BlockPool:
        return self._pool

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
        _check_count("num_tokens", num_tokens)
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's device block table (a new list; empty if it has none)."""
        table = self._tables.get(request_id)
        return [b.block_id for b in table.blocks] if table is not None else []

    def num_swapped_blocks(self, request: Request) -> int:
        """Blocks the request holds in the host tier (0 unless swapped out)."""
        host = self._host_tables.get(request.request_id)
        return len(host.host_blocks) if host is not None else 0

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
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return [], 0
        blocks = self._cache.match(_token_ids(request), request.cache_salt, max_blocks)
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
        t0 = time.perf_counter()
        try:
            # NOTE: checked here for every allocator (subclasses override _allocate_slots).
            if num_new_tokens < 0 or num_new_computed_tokens < 0 or reserve < 0:
                raise ValueError(
                    f"allocate_slots: num_new_tokens={num_new_tokens}, num_new_computed_tokens="
                    f"{num_new_computed_tokens} and reserve={reserve} must all be >= 0"
                )
            if request.request_id in self._host_tables:
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
        rid = request.request_id
        table = self._tables.get(rid)
        bs = self.block_size
        computed, host_hits = self._computed_blocks(
            request, table, computed_ids, num_new_computed_tokens
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
        if num_fresh + reserve > self._pool.num_free_blocks - num_revived:
            return None

        if computed:
            # NOTE: revive the prefix hits first, or the allocation below could evict them.
            self._pool.touch(computed)
        if host_hits:
            # NOTE: out of the host LRU (and pinned) first, or an offload planned by the
            # allocation below could evict them.
            self._host.take_cached(host_hits)
        fresh = self._pool.allocate(num_fresh) if num_fresh else []
        if host_hits:
            computed = computed + self._load(host_hits, fresh[:num_loads])
        first = table is None
        if table is None:
            table = self._tables[rid] = _Table(request, computed, num_hits, num_hits)
        if cow_indices:
            self._copy_on_write(table, cow_indices, fresh[num_loads + num_needed :], num_computed)
        if num_needed:
            table.blocks.extend(fresh[num_loads : num_loads + num_needed])
        if self.enable_prefix_caching:
            self._cache_full_blocks(table, min(num_total, request.num_tokens) // bs)
            if first:
                c = self.counters
                c.prefix_cache_queries += request.num_tokens
                c.prefix_cache_hits += num_new_computed_tokens
                c.host_hit_tokens += num_loads * bs
                c.device_hit_tokens += num_new_computed_tokens - num_loads * bs
        return [b.block_id for b in fresh]

    def _load(self, host_hits: list[HostBlock], fresh: list[KVBlock]) -> list[KVBlock]:
        """Put each fresh device block in its host hit's place in the tree; plan the loads.

        The host blocks are released now but stay pinned (not reused) until the step's
        plans are taken: the runner reads them in this step's swap-in phase.
        """
        for host, block in zip(host_hits, fresh, strict=True):
            self._cache.replace(host, block)
            self._pending_loads.append((host, block))
        self._host.release(host_hits)
        self.counters.load_blocks += len(host_hits)
        return fresh

    def _on_device_evict(self, block: KVBlock) -> None:
        """The pool hands out cached ``block`` again: offload it to the host tier or drop it.

        Offload: a host block (free, or the oldest unpinned offloaded one, evicted) takes
        its place in the tree and (device, host) is planned; the runner copies it out in
        this step's swap-out phase, before anything writes the device block. Drop: without
        the tier or a host block, ``block`` leaves the tree with its subtree, whose blocks
        are all host-resident (its device descendants were evicted before it).
        """
        if self.enable_host_prefix_cache and self._host.num_free_blocks:
            (host,) = self._host.allocate(1)
            self._cache.replace(block, host)
            self._host.add_cached(host)
            self._pending_offloads.append((block.block_id, host))
            self.counters.offload_blocks += 1
            return
        removed = self._cache.remove_subtree(block)
        dropped: list[HostBlock] = []
        for host in removed[1:]:
            assert isinstance(host, HostBlock), (
                f"evicting block {block.block_id}: its cached descendant {describe(host)} is "
                "device-resident (residency order broken)"
            )
            self._host.uncache(host)
            dropped.append(host)
        self._host.release(dropped)
        self.counters.host_cache_evictions += len(dropped)

    def _on_host_evict(self, host: HostBlock) -> None:
        """The host tier hands out an offloaded block again: the prefix cache forgets it."""
        self._cache.evict(host)
        self.counters.host_cache_evictions += 1

    def _computed_blocks(
        self,
        request: Request,
        table: _Table | None,
        computed_ids: list[int],
        num_new_computed_tokens: int,
    ) -> tuple[list[KVBlock], list[HostBlock]]:
        """Validate ``allocate_slots``' prefix-hit arguments; resolve device and host hits."""
        if not computed_ids and not num_new_computed_tokens:
            return [], []
        rid = request.request_id
        if table is not None:
            raise ValueError(
                f"new_computed_blocks given for request {rid!r}, which already has a block "
                "table: prefix hits join only on the first allocation"
            )
        if request.num_computed_tokens != 0:
            raise ValueError(
                f"request {rid!r} has num_computed_tokens={request.num_computed_tokens}; "
                "prefix hits join only a request that has computed nothing"
            )
        if num_new_computed_tokens != len(computed_ids) * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} but "
                f"{len(computed_ids)} computed blocks hold {len(computed_ids) * self.block_size}"
            )
        blocks: list[KVBlock] = []
        host_hits: list[HostBlock] = []
        for block_id in computed_ids:
            entry: CacheEntry
            if not isinstance(block_id, int) or isinstance(block_id, bool):
                raise ValueError(f"new_computed_blocks: {block_id!r} is not a block id")
            if 0 <= block_id < self.num_blocks and not host_hits:
                entry = self._pool.blocks[block_id]
            elif -self.num_host_blocks <= block_id < 0:
                entry = self._host.blocks[-1 - block_id]
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

    def _copy_on_write(
        self, table: _Table, indices: list[int], fresh: list[KVBlock], num_computed: int
    ) -> None:
        """Replace the blocks at ``indices`` (ascending) by ``fresh`` ones.

        A replaced block that holds computed tokens (only the first, when the write starts
        mid-block) is copied: (old, new) is queued and old keeps this table's reference as
        a pin. The others are overwritten in full, so they are just released, tail first.
        """
        released = []
        for i, new in zip(reversed(indices), fresh, strict=True):
            old = table.blocks[i]
            table.blocks[i] = new
            if i * self.block_size < num_computed:
                self._pending_copies.append((old, new))
                self.counters.cow_copies += 1
            else:
                released.append(old)
        self._pool.free(released)
        # The table's cached run now ends before the first replaced block.
        table.num_cached_blocks = min(table.num_cached_blocks, indices[0])
        table.num_full_checked = min(table.num_full_checked, indices[0])

    def _cache_full_blocks(self, table: _Table, num_full: int) -> None:
        """Offer the table's full blocks [num_cached_blocks, num_full) to the prefix cache.

        Stops at the first block whose path is already cached under another block (the
        request keeps its duplicate uncached); retried once more blocks fill up.
        """
        if num_full <= table.num_full_checked:
            return
        table.num_full_checked = num_full
        i = table.num_cached_blocks
        blocks = table.blocks
        request = table.request
        bs = self.block_size
        parent = blocks[i - 1] if i else None
        while i < num_full:
            block = blocks[i]
            if block.cache_node is not None:
                break  # shared by fork under a longer path: not this request's to extend
            key = tuple(request.token_ids_slice(i * bs, (i + 1) * bs))
            if not self._cache.insert(parent, request.cache_salt, key, block):
                break
            parent = block
            i += 1
        table.num_cached_blocks = i

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) device block pairs queued since the last call; clears.

        Releases the pins on the sources: call once per step, after the last allocation.
        """
        if not self._pending_copies:
            return []
        pending, self._pending_copies = self._pending_copies, []
        self._pool.free(src for src, _ in pending)
        return [(src.block_id, dst.block_id) for src, dst in pending]

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The offload tier's plans since the last call: (offloads, loads); clears.

        offloads: (device, host) pairs for the step's ``blocks_to_swap_out``; loads: (host,
        device) pairs for its ``blocks_to_swap_in``. Ends the step's host-block pins: call
        once per step, after the last allocation (with ``take_pending_copies``).
        """
        offloads = [(d, h.host_block_id) for d, h in self._pending_offloads]
        loads = [(h.host_block_id, d.block_id) for h, d in self._pending_loads]
        self._pending_offloads = []
        self._pending_loads = []
        self._host.end_step()
        return offloads, loads

    # ------------------------------------------------------------------ free / fork

    def free(self, request: Request) -> None:
        """Drop the request's device and host blocks. No-op for unknown requests.

        Device blocks are released tail first: cached ones stay matchable (evictable, the
        tail before the head), uncached ones are reused first.
        """
        rid = request.request_id
        table = self._tables.pop(rid, None)
        if table is not None:
            self._pool.free(reversed(table.blocks))
        host = self._host_tables.pop(rid, None)
        if host is not None:
            self._host.release(reversed(host.host_blocks))

    def forget_unwritten(self, request: Request, num_written_tokens: int) -> int:
        """Take the request's blocks from token ``num_written_tokens`` on out of the prefix cache.

        For a request whose step failed: its new blocks were offered to the prefix cache when
        they were allocated, but their KV was never (or wrongly) written, so no later request
        may match them. Call before ``free``. Returns the number of blocks forgotten.
        """
        table = self._tables.get(request.request_id)
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
            for t in self._tables.values():
                n = 0
                while n < t.num_cached_blocks and t.blocks[n].cache_node is not None:
                    n += 1
                t.num_cached_blocks = n
                t.num_full_checked = min(t.num_full_checked, n)
        return len(removed)

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's whole block table, every block's ref count +1.

        The child's tokens must agree with the parent's over the positions the parent has
        computed (the shared K/V). Its first write into a shared block copies it.
        """
        pid, cid = parent.request_id, child.request_id
        ptable = self._tables.get(pid)
        if ptable is None:
            raise ValueError(f"fork: parent {pid!r} has no device block table")
        if cid == pid or cid in self._tables or cid in self._host_tables:
            raise ValueError(f"fork: child {cid!r} already has blocks")
        num_shared = min(child.num_tokens, parent.num_computed_tokens)
        if child.token_ids_slice(0, num_shared) != parent.token_ids_slice(0, num_shared):
            raise ValueError(
                f"fork: child {cid!r}'s tokens differ from parent {pid!r}'s computed tokens"
            )
        self._pool.touch(ptable.blocks)
        num_cached = min(ptable.num_cached_blocks, num_shared // self.block_size)
        self._tables[cid] = _Table(child, list(ptable.blocks), num_cached, num_cached)
        self.counters.fork_shared_blocks += len(ptable.blocks)

    # ------------------------------------------------------------------ swap

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host tier: (device, host) pairs, table order.

        Drops the device references (as ``free`` does). Returns None, changing nothing, if
        the host tier has fewer free blocks than the table.
        """
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            raise ValueError(f"swap_out: request {rid!r} has no device block table")
        if any(dst in table.blocks for _, dst in self._pending_copies):
            raise ValueError(f"swap_out: request {rid!r} has a copy-on-write pending in this step")
        if any(dst in table.blocks for _, dst in self._pending_loads):
            raise ValueError(f"swap_out: request {rid!r} has a host load pending in this step")
        num = len(table.blocks)
        if num > self._host.num_free_blocks:
            return None
        # NOTE: may evict offloaded prefix blocks (oldest first); swapped requests come first.
        hosts = self._host.allocate(num)
        del self._tables[rid]
        self._pool.free(reversed(table.blocks))
        self._host_tables[rid] = _HostTable(request, hosts)
        self.counters.swap_out_blocks += num
        return [(b.block_id, h.host_block_id) for b, h in zip(table.blocks, hosts, strict=True)]

    def swap_in(self, request: Request, reserve: int = 0) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request back: (host, device) pairs to copy.

        Leading full computed blocks still in the prefix cache are reused instead of
        copied. Returns None, changing nothing, if fewer than ``needed + reserve`` blocks
        can be had.
        """
        t0 = time.perf_counter()
        try:
            return self._swap_in(request, reserve)
        finally:
            self.counters.alloc_time_s += time.perf_counter() - t0
            self.counters.alloc_calls += 1

    def _swap_in(self, request: Request, reserve: int) -> list[tuple[int, int]] | None:
        _check_count("reserve", reserve)
        rid = request.request_id
        host = self._host_tables.get(rid)
        if host is None:
            raise ValueError(f"swap_in: request {rid!r} is not swapped out")
        hosts = host.host_blocks
        reused: list[KVBlock] = []
        if self.enable_prefix_caching:
            max_blocks = min(len(hosts), request.num_computed_tokens // self.block_size)
            for b in self._cache.match(_token_ids(request), request.cache_salt, max_blocks):
                if isinstance(b, HostBlock):
                    break  # host-resident: the request's own host copy is loaded instead
                reused.append(b)
        num_needed = len(hosts) - len(reused)
        num_revived = sum(1 for b in reused if b.ref_cnt == 0)
        if num_needed + reserve > self._pool.num_free_blocks - num_revived:
            return None
        self._pool.touch(reused)
        fresh = self._pool.allocate(num_needed)
        del self._host_tables[rid]
        # NOTE: read in this step's swap-in phase: pinned until the plans are taken.
        self._host.pin(hosts[len(reused) :])
        self._host.release(reversed(hosts))
        table = self._tables[rid] = _Table(request, reused + fresh, len(reused), len(reused))
        if self.enable_prefix_caching:
            self._cache_full_blocks(table, request.num_computed_tokens // self.block_size)
        self.counters.swap_in_blocks += num_needed
        return [
            (h.host_block_id, b.block_id) for h, b in zip(hosts[len(reused) :], fresh, strict=True)
        ]

    # ------------------------------------------------------------------ cache admin

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Only when no block is held; returns whether it did."""
        if self._pool.num_free_blocks != self._pool.num_usable_blocks:
            return False
        self._cache.clear()
        cached = list(self._host.lru.values())
        for host in cached:
            self._host.uncache(host)
        self._host.release(cached)
        return True

    # ------------------------------------------------------------------ figures

    def snapshot(self) -> dict[str, float | int]:
        """Every capacity figure by name (see CONTRACTS.md); O(total table length)."""
        util = kv_utilization(
            (
                ([b.block_id for b in t.blocks], t.request.num_computed_tokens)
                for t in self._tables.values()
            ),
            self.block_size,
        )
        c = self.counters
        return {
            "num_kv_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_free_blocks": self.num_free_blocks,
            "kv_usage": self.usage,
            "kv_utilization": util,
            # NOTE: 0 when idle (nothing allocated), 1 when blocks are allocated but empty.
            "fragmentation": 1.0 - util if self._tables else 0.0,
            "prefix_cache_queries": c.prefix_cache_queries,
            "prefix_cache_hits": c.prefix_cache_hits,
            "prefix_hit_rate": ratio(c.prefix_cache_hits, c.prefix_cache_queries),
            "prefix_cache_evictions": self._pool.num_evictions,
            "cow_copies": c.cow_copies,
            "fork_shared_blocks": c.fork_shared_blocks,
            "swap_out_blocks": c.swap_out_blocks,
            "swap_in_blocks": c.swap_in_blocks,
            "num_host_blocks": self.num_host_blocks,
            "num_free_host_blocks": self.num_free_host_blocks,
            "device_hit_tokens": c.device_hit_tokens,
            "host_hit_tokens": c.host_hit_tokens,
            "host_cache_blocks": self._host.num_cached_blocks,
            "host_cache_evictions": c.host_cache_evictions,
            "offload_blocks": c.offload_blocks,
            "load_blocks": c.load_blocks,
            "alloc_time_s": c.alloc_time_s,
            "alloc_calls": c.alloc_calls,
        }

    def dump_state(self) -> dict[str, object]:
        """Everything that defines the manager's state, as plain comparable data.

        Tests compare it before and after an operation that must change nothing. Timing
        counters (alloc_time_s, alloc_calls) are left out: they measure, they are not state.
        """
        figures = self.snapshot()
        del figures["alloc_time_s"], figures["alloc_calls"]
        return {
            "tables": {
                rid: ([b.block_id for b in t.blocks], t.num_cached_blocks, t.num_full_checked)
                for rid, t in self._tables.items()
            },
            "host_tables": {
                rid: [h.host_block_id for h in t.host_blocks]
                for rid, t in self._host_tables.items()
            },
            "free_host_ids": list(self._host.free_ids),
            "host_lru": list(self._host.lru),
            "host_pinned": sorted(self._host.pinned_ids),
            "host_deferred": list(self._host.deferred_ids),
            "pending_offloads": [(d, h.host_block_id) for d, h in self._pending_offloads],
            "pending_loads": [(h.host_block_id, d.block_id) for h, d in self._pending_loads],
            "free_block_ids": self._pool.free_block_ids(),
            "ref_cnts": [b.ref_cnt for b in self._pool.blocks],
            "cached": [b.cache_node is not None for b in self._pool.blocks],
            "prefix_cache": self._cache.dump(),
            "pending_copies": [(s.block_id, d.block_id) for s, d in self._pending_copies],
            "figures": figures,
        }

    # ------------------------------------------------------------------ integrity

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant (module docstring)."""
        pool, cache = self._pool, self._cache
        pool.check_integrity()
        cache.check_integrity()
        assert not (self._tables.keys() & self._host_tables.keys()), (
            "a request has both a device and a host block table"
        )
        holders: Counter[int] = Counter()
        for rid, table in self._tables.items():
            ids = [b.block_id for b in table.blocks]
            assert len(set(ids)) == len(ids), f"request {rid!r} holds a block twice: {ids}"
            holders.update(ids)
            self._check_table(rid, table)
        holders.update(src.block_id for src, _ in self._pending_copies)
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: ref {block.ref_cnt} but held by "
                f"{holders[block.block_id]} tables / copy pins"
            )
        num_cached = sum(b.cache_node is not None for b in pool.blocks)
        num_host_cached = self._host.num_cached_blocks
        assert num_cached + num_host_cached == cache.num_cached_blocks, (
            f"{num_cached} pool blocks and {num_host_cached} host blocks are marked cached, "
            f"the prefix cache maps {cache.num_cached_blocks}"
        )
        assert self.enable_prefix_caching or num_cached == 0, "caching is off but blocks cached"
        assert self.enable_host_prefix_cache or num_host_cached == 0, (
            "the host prefix tier is off but host blocks are cached"
        )
        self._check_eviction_order()
        self._check_host_tier()

    def _check_host_tier(self) -> None:
        """Host ids partitioned; host LRU evicts leaves; step plans pinned and consistent."""
        host = self._host
        host.check_integrity(
            h.host_block_id for t in self._host_tables.values() for h in t.host_blocks
        )
        position = {i: n for n, i in enumerate(host.lru)}
        for i, block in host.lru.items():
            parent = self._cache.parent_block(block)
            if isinstance(parent, HostBlock):
                assert position[parent.host_block_id] > position[i], (
                    f"host block {i} would be evicted after its host parent {parent.host_block_id}"
                )
        dsts = [h.host_block_id for _, h in self._pending_offloads]
        assert len(set(dsts)) == len(dsts), f"two offloads target one host block: {dsts}"
        for d, h in self._pending_offloads:
            assert 0 <= d < self.num_blocks, f"offload source {d} is not a device block"
            assert h.host_block_id in host.pinned_ids, (
                f"offload destination host block {h.host_block_id} is not pinned"
            )
        for h, d in self._pending_loads:
            assert h.host_block_id in host.pinned_ids and h.cache_node is None, (
                f"load source host block {h.host_block_id} is not pinned, or still cached"
            )
            assert d.ref_cnt > 0, f"load destination block {d.block_id} is not held"

    def _check_table(self, rid: str, table: _Table) -> None:
        blocks = table.blocks
        num_leading = 0
        while num_leading < len(blocks) and blocks[num_leading].cache_node is not None:
            num_leading += 1
        for i in range(num_leading):
            want_parent = blocks[i - 1] if i else None
            assert self._cache.parent_block(blocks[i]) is want_parent, (
                f"request {rid!r}: cached block {blocks[i].block_id} is not on its path"
            )
        for block in blocks[num_leading:]:
            assert block.cache_node is None, (
                f"request {rid!r}: cached block {block.block_id} after an uncached one"
            )
        n = table.num_cached_blocks
        assert n <= num_leading and n <= table.num_full_checked, (
            f"request {rid!r}: num_cached_blocks={n} is inconsistent"
        )
        request = table.request
        assert n * self.block_size <= request.num_tokens, f"request {rid!r}: cached past its end"
        matched = self._cache.match(_token_ids(request), request.cache_salt, n)
        assert matched == blocks[:n], (  # KVBlock compares by identity
            f"request {rid!r}: its cached blocks are not what its tokens match"
        )

    def _check_eviction_order(self) -> None:
        """Held cached blocks have held parents; free ones precede their free parents."""
        position = {b.block_id: i for i, b in enumerate(self._pool.free_blocks())}
        for block in self._pool.blocks:
            if block.cache_node is None:
                continue
            parent = self._cache.parent_block(block)
            if parent is None:
                continue
            assert isinstance(parent, KVBlock), (
                f"cached block {block.block_id} has a host-resident parent {describe(parent)}"
            )
            if block.ref_cnt > 0:
                assert parent.ref_cnt > 0, (
                    f"cached block {block.block_id} is held but its parent {parent.block_id} "
                    "is free (ancestor closure broken)"
                )
            elif parent.ref_cnt == 0:
                assert position[block.block_id] < position[parent.block_id], (
                    f"free cached block {block.block_id} would be evicted after its parent "
                    f"{parent.block_id}"
                )
