"""Capacity figures of the KV cache, in one place (names as in DESIGN.md and CONTRACTS.md).

``KVCacheCounters`` holds the monotonic counters the manager bumps on its paths;
``kv_utilization`` and ``ratio`` turn state into the derived figures of ``snapshot()``:

- kv_usage: blocks referenced by live requests / total blocks (cached-but-free ones don't
  count).
- kv_utilization: tokens actually stored / (allocated blocks x block_size) over live
  requests, a block shared by several tables counted once; fragmentation = 1 - utilization.
  Both are 0 when nothing is allocated.
- prefix_hit_rate: prompt tokens served from the prefix cache / prompt tokens looked up,
  both tiers (device_hit_tokens + host_hit_tokens = prefix_cache_hits).
- offload_blocks / load_blocks: blocks moved device -> host / host -> device by the host
  prefix tier (swap_out_blocks / swap_in_blocks count swap preemption); bytes moved =
  blocks x the runtime's bytes per block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields


@dataclass(slots=True)
class KVCacheCounters:
    """Monotonic counters of the KV cache manager (reset only by a new manager)."""

    prefix_cache_queries: int = 0  # tokens looked up at first allocations
    prefix_cache_hits: int = 0  # of which served from the prefix cache
    cow_copies: int = 0  # (src, dst) block copies queued by copy-on-write
    fork_shared_blocks: int = 0  # blocks shared instead of copied by fork()
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0  # blocks copied back (prefix-cache hits at swap-in need none)
    device_hit_tokens: int = 0  # prefix hits served by device-resident blocks
    host_hit_tokens: int = 0  # prefix hits served by host-resident blocks (loaded back)
    offload_blocks: int = 0  # evicted cached blocks copied device -> host (prefix tier)
    load_blocks: int = 0  # host-resident prefix blocks copied host -> device on a hit
    host_cache_evictions: int = 0  # offloaded blocks dropped from the host tier
    alloc_time_s: float = 0.0  # time.perf_counter() spent in allocate_slots / swap_in
    alloc_calls: int = 0

    def as_dict(self) -> dict[str, float | int]:
        """The counters by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def ratio(num: float, den: float) -> float:
    """``num / den``, or 0.0 when ``den`` is 0 (an idle engine reports zeros, not NaN)."""
    return num / den if den else 0.0


def kv_utilization(tables: Iterable[tuple[Sequence[int], int]], block_size: int) -> float:
    """Tokens stored / (distinct allocated blocks x block_size).

    ``tables`` yields (block ids, number of computed tokens) per live request. Token p of
    a request sits in its block p // block_size, so a block is as full as the furthest any
    of its holders has computed into it. O(total table length), at C speed for full blocks.
    """
    filled: dict[int, int] = {}
    for block_ids, num_computed in tables:
        num_full = min(num_computed // block_size, len(block_ids))
        filled.update(dict.fromkeys(block_ids[:num_full], block_size))
        if num_full < len(block_ids):
            partial = block_ids[num_full]
            used = num_computed - num_full * block_size  # < block_size here
            filled[partial] = max(filled.get(partial, 0), used)
            for block_id in block_ids[num_full + 1 :]:
                filled.setdefault(block_id, 0)
    return ratio(sum(filled.values()), len(filled) * block_size)
