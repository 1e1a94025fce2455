"""The host prefix tier: a second level of the prefix cache in host memory.

``KVCacheManager(enable_host_prefix_cache=True)`` keeps cached blocks the device pool
evicts: when the pool hands out a free cached block again, ``on_device_evict`` copies it to a
host block (free, or the oldest unpinned offloaded one, itself evicted) and the prefix tree
keeps the path, now host-resident; with no host block to be had (or the tier off), the block
is dropped with its (host-resident) subtree. A later ``get_computed_blocks`` matches
host-resident blocks too; ``allocate_slots`` gives each a fresh device block and this tier
plans a host->device load.

Plans of one step, handed over by ``take_plans()`` (the manager's ``take_pending_swaps``):
offloads (device id, host) go to the step's ``blocks_to_swap_out`` and loads (host, device)
to its ``blocks_to_swap_in``, so the runner copies an evicted block out before this step's
forward pass overwrites it, and loads before the forward pass reads. Host blocks written or
read by a plan are pinned until then (``HostTier`` step pins).

Invariants (``check_integrity``): a cached host block's host parent comes after it in the
host LRU (the tier only evicts leaves); an offload destination or load source is pinned; a
load's device destination is held. The host ids themselves (free / held / cached /
deferred) are ``HostTier``'s, shared with swap preemption, whose blocks are never evicted.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvserve.core.errors import IntegrityError
from kvserve.core.kv.block_pool import KVBlock
from kvserve.core.kv.host_tier import HostBlock, HostTier
from kvserve.core.kv.metrics import KVCacheCounters
from kvserve.core.kv.prefix_cache import PrefixCache, describe


class HostPrefixTier:
    """Offload / load planning and pins of the host prefix tier. See the module docstring.

    ``tier`` is the host block space, shared with swap preemption (the manager allocates a
    swapped-out request's host blocks from it). With ``enabled=False`` nothing is offloaded:
    an evicted cached device block simply leaves the prefix tree.
    """

    def __init__(
        self,
        num_host_blocks: int,
        *,
        enabled: bool,
        cache: PrefixCache,
        counters: KVCacheCounters,
    ) -> None:
        self.enabled = enabled
        self.cache = cache
        self.counters = counters
        self.tier = HostTier(num_host_blocks, step_pins=enabled, on_evict=self._on_host_evict)
        self._pending_offloads: list[tuple[int, HostBlock]] = []  # (device id, host)
        self._pending_loads: list[tuple[HostBlock, KVBlock]] = []  # (host, device)

    # ------------------------------------------------------------------ eviction hooks

    def on_device_evict(self, block: KVBlock) -> None:
        """The pool hands out cached ``block`` again: offload it to the host tier or drop it.

        Offload: a host block (free, or the oldest unpinned offloaded one, evicted) takes
        its place in the tree and (device, host) is planned; the runner copies it out in
        this step's swap-out phase, before anything writes the device block. Drop: without
        the tier or a host block, ``block`` leaves the tree with its subtree, whose blocks
        are all host-resident (its device descendants were evicted before it).
        """
        if self.enabled and self.tier.num_free_blocks:
            (host,) = self.tier.allocate(1)
            self.cache.replace(block, host)
            self.tier.add_cached(host)
            self._pending_offloads.append((block.block_id, host))
            self.counters.offload_blocks += 1
            return
        removed = self.cache.remove_subtree(block)
        dropped: list[HostBlock] = []
        for host in removed[1:]:
            if not isinstance(host, HostBlock):
                raise IntegrityError(
                    f"evicting block {block.block_id}: its cached descendant {describe(host)} "
                    "is device-resident (residency order broken)"
                )
            self.tier.uncache(host)
            dropped.append(host)
        self.tier.release(dropped)
        self.counters.host_cache_evictions += len(dropped)

    def _on_host_evict(self, host: HostBlock) -> None:
        """The host tier hands out an offloaded block again: the prefix cache forgets it."""
        self.cache.evict(host)
        self.counters.host_cache_evictions += 1

    # ------------------------------------------------------------------ hits and loads

    def claim(self, host_hits: list[HostBlock]) -> None:
        """Host hits about to be loaded: out of the host LRU and pinned.

        NOTE: call before the device allocation, or an offload planned by it could evict them.
        """
        self.tier.take_cached(host_hits)

    def load(self, host_hits: list[HostBlock], fresh: list[KVBlock]) -> None:
        """Put each fresh device block in its claimed host hit's place in the tree; plan loads.

        The host blocks are released now but stay pinned (not reused) until the step's
        plans are taken: the runner reads them in this step's swap-in phase.
        """
        for host, block in zip(host_hits, fresh, strict=True):
            self.cache.replace(host, block)
            self._pending_loads.append((host, block))
        self.tier.release(host_hits)
        self.counters.load_blocks += len(host_hits)

    def loads_into(self, blocks: Iterable[KVBlock]) -> bool:
        """True if a load planned in this step writes one of ``blocks``."""
        targets = {id(dst) for _, dst in self._pending_loads}
        return any(id(b) in targets for b in blocks)

    def take_plans(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (offloads, loads) as id pairs; clears them and ends the step's pins."""
        offloads = [(d, h.host_block_id) for d, h in self._pending_offloads]
        loads = [(h.host_block_id, d.block_id) for h, d in self._pending_loads]
        self._pending_offloads = []
        self._pending_loads = []
        self.tier.end_step()
        return offloads, loads

    def clear(self) -> None:
        """Forget every offloaded block (the prefix cache was cleared)."""
        cached = list(self.tier.lru.values())
        for host in cached:
            self.tier.uncache(host)
        self.tier.release(cached)

    # ------------------------------------------------------------------ state

    def dump(self) -> dict[str, object]:
        """Plain comparable state (for ``KVCacheManager.dump_state``)."""
        tier = self.tier
        return {
            "free_host_ids": list(tier.free_ids),
            "host_lru": list(tier.lru),
            "host_pinned": sorted(tier.pinned_ids),
            "host_deferred": list(tier.deferred_ids),
            "pending_offloads": [(d, h.host_block_id) for d, h in self._pending_offloads],
            "pending_loads": [(h.host_block_id, d.block_id) for h, d in self._pending_loads],
        }

    def check_integrity(self, swapped_host_ids: Iterable[int], num_device_blocks: int) -> None:
        """Host ids partitioned; host LRU evicts leaves; step plans pinned and consistent."""
        tier = self.tier
        tier.check_integrity(swapped_host_ids)
        if not self.enabled and tier.num_cached_blocks:
            raise IntegrityError("the host prefix tier is off but host blocks are cached")
        position = {i: n for n, i in enumerate(tier.lru)}
        for i, block in tier.lru.items():
            parent = self.cache.parent_block(block)
            if isinstance(parent, HostBlock) and position[parent.host_block_id] <= position[i]:
                raise IntegrityError(
                    f"host block {i} would be evicted after its host parent {parent.host_block_id}"
                )
        dsts = [h.host_block_id for _, h in self._pending_offloads]
        if len(set(dsts)) != len(dsts):
            raise IntegrityError(f"two offloads target one host block: {dsts}")
        for d, h in self._pending_offloads:
            if not 0 <= d < num_device_blocks:
                raise IntegrityError(f"offload source {d} is not a device block")
            if h.host_block_id not in tier.pinned_ids:
                raise IntegrityError(
                    f"offload destination host block {h.host_block_id} is not pinned"
                )
        for h, d in self._pending_loads:
            if h.host_block_id not in tier.pinned_ids or h.cache_node is not None:
                raise IntegrityError(
                    f"load source host block {h.host_block_id} is not pinned, or still cached"
                )
            if d.ref_cnt <= 0:
                raise IntegrityError(f"load destination block {d.block_id} is not held")
