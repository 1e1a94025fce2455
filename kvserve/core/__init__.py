"""The memory core: pure Python, no torch. Every test here runs in milliseconds.

- ``block_pool``: physical block ids, ref counts, the O(1) eviction-ordered free list.
- ``prefix_cache``: the ``PrefixCache`` interface and its radix-tree implementation.
- ``kv_cache_manager``: block tables, prefix hits, copy-on-write, fork, swap plans.
- ``metrics``: the capacity figures.
- ``host_tier``: host-memory blocks shared by swap preemption and the prefix offload tier.
- ``window``: windowed eviction with attention sinks (a KVCacheManager subclass).
- ``contiguous``: the naive per-request contiguous reservation, for comparison (a subclass).
- ``scheduler``: token-budget continuous batching on top of the manager.
- ``step_cost`` / ``step_budget``: an online step cost model and the step-time budget that
  sizes prefill chunks with it (the scheduler calls it once a step).
"""

from kvserve.core.block_pool import BlockPool, FreeBlockQueue, KVBlock
from kvserve.core.contiguous import ContiguousKVCacheManager
from kvserve.core.host_tier import HostBlock, HostTier
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.metrics import KVCacheCounters
from kvserve.core.prefix_cache import PrefixCache, RadixPrefixCache
from kvserve.core.window import KVWindow, WindowedKVCacheManager

__all__ = [
    "BlockPool",
    "ContiguousKVCacheManager",
    "FreeBlockQueue",
    "HostBlock",
    "HostTier",
    "KVBlock",
    "KVCacheCounters",
    "KVCacheManager",
    "KVWindow",
    "PrefixCache",
    "RadixPrefixCache",
    "WindowedKVCacheManager",
]
