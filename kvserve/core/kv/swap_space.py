"""Swap preemption's side of the host tier: swapped-out requests' host block tables.

``KVCacheManager.swap_out`` stores a request's blocks here (``store``) and ``swap_in`` takes
them back (``restore``); the device side stays the manager's. The host block ids are
``HostTier``'s, shared with the host prefix tier, which never evicts a swapped request's
blocks (they are held, outside the tier's LRU).
"""

from __future__ import annotations

from collections.abc import Iterator

from kvserve.core.kv.block_pool import KVBlock
from kvserve.core.kv.host_tier import HostBlock, HostTier
from kvserve.core.kv.metrics import KVCacheCounters
from kvserve.core.kv.tables import HostTable
from kvserve.request import Request


class SwapSpace:
    """Host block tables of swapped-out requests, by request id."""

    def __init__(self, tier: HostTier, counters: KVCacheCounters) -> None:
        self.tier = tier
        self.counters = counters  # the manager's: swap_out_blocks, swap_in_blocks
        self._tables: dict[str, HostTable] = {}
        # Device blocks this step's swap-in copies into (unwritten until the step runs);
        # cleared by the manager's take_pending_swaps().
        self.restoring: set[KVBlock] = set()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tables

    def request_ids(self) -> Iterator[str]:
        """Ids of the swapped-out requests."""
        return iter(self._tables)

    def num_blocks(self, request_id: str) -> int:
        """Host blocks the request holds (0 unless swapped out)."""
        table = self._tables.get(request_id)
        return len(table.host_blocks) if table is not None else 0

    def host_blocks(self, request_id: str) -> list[HostBlock] | None:
        """The request's host blocks in table order, or None if it is not swapped out."""
        table = self._tables.get(request_id)
        return table.host_blocks if table is not None else None

    def store(self, request: Request, moved: list[KVBlock]) -> list[tuple[int, int]] | None:
        """Take a host block per block of ``moved`` for ``request``: the (device, host) copy
        plan, or None (nothing changed) if the tier has too few.

        NOTE: may evict offloaded prefix blocks (oldest first); swapped requests come first.
        """
        if len(moved) > self.tier.num_free_blocks:
            return None
        hosts = self.tier.allocate(len(moved))
        self._tables[request.request_id] = HostTable(request, hosts)
        self.counters.swap_out_blocks += len(moved)
        return [(b.block_id, h.host_block_id) for b, h in zip(moved, hosts, strict=True)]

    def restore(
        self, request_id: str, blocks: list[KVBlock], num_reused: int
    ) -> list[tuple[int, int]]:
        """The request is swapped in to device ``blocks``: release its host blocks and return
        the (host, device) copy plan for those past the ``num_reused`` reused prefix hits.

        ``host_blocks[num_reused:]`` are read in this step's swap-in phase, so they are
        pinned until the step's plans are taken (free only then, with step pins on).
        """
        hosts = self._tables.pop(request_id).host_blocks
        self.tier.pin(hosts[num_reused:])
        self.tier.release(reversed(hosts))
        copied = blocks[num_reused : len(hosts)]
        self.restoring.update(copied)
        self.counters.swap_in_blocks += len(copied)
        return [
            (h.host_block_id, b.block_id) for h, b in zip(hosts[num_reused:], copied, strict=True)
        ]

    def free(self, request_id: str) -> None:
        """Drop the request's host blocks (a swapped request finished). No-op if none."""
        table = self._tables.pop(request_id, None)
        if table is not None:
            self.tier.release(reversed(table.host_blocks))

    def held_ids(self) -> Iterator[int]:
        """Every host id a swapped-out request holds."""
        return (h.host_block_id for t in self._tables.values() for h in t.host_blocks)

    def dump(self) -> dict[str, list[int]]:
        """Host block ids by request id (plain comparable state)."""
        return {rid: [h.host_block_id for h in t.host_blocks] for rid, t in self._tables.items()}
