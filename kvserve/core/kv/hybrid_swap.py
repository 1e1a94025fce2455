"""Swap preemption of ``HybridKVCacheManager``: every group's live blocks to the host tier
and back (a mixin: it reads the manager's tables, pool and host tier).

A swapped-out request keeps, per group, its table's length and the (index, host block) of
each live entry; null entries (blocks out of a sliding window) take no host block and come
back null. Swap-in copies every block back (no prefix reuse at swap-in).
"""

from __future__ import annotations

from kvserve.core.kv.block_pool import BlockPool, KVBlock
from kvserve.core.kv.block_tables import check_count
from kvserve.core.kv.host_tier import HostBlock, HostTier
from kvserve.core.kv.metrics import KVCacheCounters
from kvserve.core.kv.tables import BlockTable
from kvserve.request import Request

# A swapped-out request's blocks, per group: (table length, [(index, host block)]).
HostGroups = list[tuple[int, list[tuple[int, HostBlock]]]]


class HybridSwap:
    """``swap_out`` / ``swap_in`` / ``num_swapped_blocks`` over the manager's state."""

    _tables: list[dict[str, BlockTable]]
    _swapped: dict[str, HostGroups]
    _pool: BlockPool
    _host: HostTier
    _null: KVBlock
    _pending_copies: list[tuple[KVBlock, KVBlock]]
    counters: KVCacheCounters
    enable_prefix_caching: bool
    block_size: int

    def _cache_full_blocks(self, request: Request, num_full: int) -> None:
        raise NotImplementedError

    def num_swapped_blocks(self, request: Request) -> int:
        """Host blocks the request holds (0 unless swapped out)."""
        groups = self._swapped.get(request.request_id)
        return sum(len(pairs) for _, pairs in groups) if groups else 0

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move every group's live blocks to the host tier: (device, host) pairs. None,
        changing nothing, if the host tier has too few free blocks."""
        rid = request.request_id
        if rid not in self._tables[0]:
            raise ValueError(f"swap_out: request {rid!r} has no device block table")
        tables = [t[rid] for t in self._tables]
        live = [[(i, b) for i, b in enumerate(t.blocks) if b is not self._null] for t in tables]
        moved = [b for g in live for _, b in g]
        if any(dst in moved for _, dst in self._pending_copies):
            raise ValueError(f"swap_out: request {rid!r} has a copy-on-write pending in this step")
        if len(moved) > self._host.num_free_blocks:
            return None
        hosts = iter(self._host.allocate(len(moved)))
        record: HostGroups = []
        pairs = []
        for t, g in zip(tables, live, strict=True):
            got = [(i, next(hosts)) for i, _ in g]
            record.append((len(t.blocks), got))
            pairs.extend(
                (b.block_id, h.host_block_id) for (_, b), (_, h) in zip(g, got, strict=True)
            )
        for t in self._tables:
            table = t.pop(rid)
            self._pool.free(b for b in reversed(table.blocks) if b is not self._null)
        self._swapped[rid] = record
        self.counters.swap_out_blocks += len(moved)
        return pairs

    def swap_in(self, request: Request, reserve: int = 0) -> list[tuple[int, int]] | None:
        """Give a swapped-out request its tables back: (host, device) pairs to copy. None,
        changing nothing, if fewer than its blocks + ``reserve`` are free."""
        with self.counters.timing_alloc():
            check_count("reserve", reserve)
            rid = request.request_id
            record = self._swapped.get(rid)
            if record is None:
                raise ValueError(f"swap_in: request {rid!r} is not swapped out")
            num = sum(len(pairs) for _, pairs in record)
            if num + reserve > self._pool.num_free_blocks:
                return None
            fresh = iter(self._pool.allocate(num))
            out = []
            for tables, (length, pairs) in zip(self._tables, self._swapped.pop(rid), strict=True):
                blocks = [self._null] * length
                for i, h in pairs:
                    blocks[i] = next(fresh)
                    out.append((h.host_block_id, blocks[i].block_id))
                tables[rid] = BlockTable(request, blocks)
                self._host.release(reversed([h for _, h in pairs]))
            self.counters.swap_in_blocks += num
            if self.enable_prefix_caching:
                self._cache_full_blocks(request, request.num_computed_tokens // self.block_size)
            return out
