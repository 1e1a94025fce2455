"""Planning ``KVCacheManager``'s allocations before anything changes (all-or-nothing).

Functions of public state only; the manager applies what they decide:

- ``plan_slots``: for ``allocate_slots``, resolve the prefix hits, count the blocks past the
  table's end and find the existing blocks a write must replace (copy-on-write);
  ``SlotPlan.fits`` says whether the pool can give them. Applied by ``_allocate_slots``,
  whose docstring draws the token range.
- ``swap_in_blocks``: the default swapped-in table (reused device prefix hits, then fresh
  blocks), held on return. Used by ``_blocks_for_swap_in``, whose caller ``_swap_in`` draws
  the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.core.kv.block_pool import BlockPool, KVBlock
from kvserve.core.kv.host_tier import HostBlock, HostTier
from kvserve.core.kv.prefix_cache import PrefixCache
from kvserve.core.kv.prefix_hits import device_prefix, match_prefix, resolve_prefix_hits
from kvserve.core.kv.tables import BlockTable
from kvserve.request import Request


# NOTE: not frozen: built on every allocate_slots call (a hot path), where a frozen
# dataclass's object.__setattr__ per field costs time; nobody mutates a plan.
@dataclass(slots=True)
class SlotPlan:
    """What one ``allocate_slots`` call needs; nothing is held until it is applied."""

    computed: list[KVBlock]  # device prefix hits: revived (touched), never copied
    host_hits: list[HostBlock]  # host-resident prefix hits: a fresh block and a load each
    num_needed: int  # fresh blocks appended past the table's end for new tokens
    cow_indices: list[int]  # existing blocks the step writes that are not writable, ascending
    num_revived: int  # device hits at ref 0: they leave the free count when touched
    num_computed: int  # tokens computed once the hits join (request + new computed)
    num_total: int  # num_computed + the new tokens

    @property
    def num_hits(self) -> int:
        """Prefix-hit blocks (device and host) that join the table."""
        return len(self.computed) + len(self.host_hits)

    @property
    def num_fresh(self) -> int:
        """Blocks to allocate: host-hit loads, new blocks, copy-on-write replacements (in
        that order in the allocation)."""
        return len(self.host_hits) + self.num_needed + len(self.cow_indices)

    def fits(self, num_free_blocks: int, reserve: int) -> bool:
        """True if the fresh blocks plus ``reserve`` fit in the free blocks left after the
        revived hits."""
        return self.num_fresh + reserve <= num_free_blocks - self.num_revived


def plan_slots(
    request: Request,
    table: BlockTable | None,
    computed_ids: list[int],
    num_new_computed_tokens: int,
    num_new_tokens: int,
    *,
    block_size: int,
    pool: BlockPool,
    host_tier: HostTier,
) -> SlotPlan:
    """Plan an ``allocate_slots`` call for ``request`` (its device ``table``, None before its
    first allocation). Raises ValueError for bad prefix hits (``resolve_prefix_hits``)."""
    bs = block_size
    computed, host_hits = resolve_prefix_hits(
        request,
        table is not None,
        computed_ids,
        num_new_computed_tokens,
        block_size=bs,
        pool=pool,
        host_tier=host_tier,
    )
    num_computed = request.num_computed_tokens + num_new_computed_tokens
    num_total = num_computed + num_new_tokens
    old_blocks = table.blocks if table is not None else []
    num_hits = len(computed) + len(host_hits)
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
    return SlotPlan(
        computed, host_hits, num_needed, cow_indices, num_revived, num_computed, num_total
    )


def swap_in_blocks(
    request: Request,
    num_host_blocks: int,
    reserve: int,
    *,
    pool: BlockPool,
    cache: PrefixCache | None,
    block_size: int,
) -> tuple[list[KVBlock], int] | None:
    """The swapped-in table's blocks and how many lead as reused device prefix hits.

    ``cache`` is None when prefix caching is off (nothing is reused). Held (touched /
    allocated) on return; None, holding nothing, if fewer than ``needed + reserve`` blocks
    can be had.
    """
    reused: list[KVBlock] = []
    if cache is not None:
        max_blocks = min(num_host_blocks, request.num_computed_tokens // block_size)
        # NOTE: device hits only: the request's own host copy beats a host-resident hit.
        reused = device_prefix(match_prefix(cache, request, max_blocks))
    num_needed = num_host_blocks - len(reused)
    num_revived = sum(1 for b in reused if b.ref_cnt == 0)
    if num_needed + reserve > pool.num_free_blocks - num_revived:
        return None
    pool.touch(reused)
    return reused + pool.allocate(num_needed), len(reused)
