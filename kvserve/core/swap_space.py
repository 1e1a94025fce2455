"""Swap preemption's side of the host tier: swapped-out requests' host block tables.

``KVCacheManager.swap_out`` stores a request's blocks here (``store``) and ``swap_in`` takes
them back (``restore``); the device side stays the manager's. The host block ids are
``HostTier``'s, shared with the host prefix tier, which never evicts a swapped request's
blocks (they are held, outside the tier's LRU).
"""

from __future__ import annotations

from collections.abc import Iterator

from kvserve.core.host_tier import HostBlock, HostTier
from kvserve.core.tables import HostTable
from kvserve.request import Request


class SwapSpace:
    """Host block tables of swapped-out requests, by request id."""

    def __init__(self, tier: HostTier) -> None:
        self.tier = tier
        self._tables: dict[str, HostTable] = {}

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

    def store(self, request: Request, num_blocks: int) -> list[HostBlock] | None:
        """Take ``num_blocks`` host blocks for ``request``; None (nothing changed) if too few.

        NOTE: may evict offloaded prefix blocks (oldest first); swapped requests come first.
        """
        if num_blocks > self.tier.num_free_blocks:
            return None
        hosts = self.tier.allocate(num_blocks)
        self._tables[request.request_id] = HostTable(request, hosts)
        return hosts

    def restore(self, request_id: str, num_reused: int) -> None:
        """The request is swapped in: release its host blocks.

        ``host_blocks[num_reused:]`` are read in this step's swap-in phase, so they are
        pinned until the step's plans are taken (free only then, with step pins on).
        """
        hosts = self._tables.pop(request_id).host_blocks
        self.tier.pin(hosts[num_reused:])
        self.tier.release(reversed(hosts))

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
