"""The memory core: pure Python, no torch. Every test here runs in milliseconds.

- ``block_pool``: physical block ids, ref counts, the O(1) eviction-ordered free list.
- ``prefix_cache``: the ``PrefixCache`` interface and its radix-tree implementation.
- ``kv_cache_manager``: block tables, prefix hits, copy-on-write, fork, swap plans; the
  protected hooks its variants override. ``tables``: the per-request records.
- ``slot_plan``: what an ``allocate_slots`` call or a swap-in needs, planned before any change.
- ``prefix_hits``: resolving prefix hits, caching and forgetting full blocks (tables <-> cache).
- ``host_tier``: host-memory block ids shared by swap preemption and the prefix offload
  tier; ``host_prefix``: the host prefix tier; ``swap_space``: swapped-out requests.
- ``window``: windowed eviction with attention sinks (a KVCacheManager variant).
- ``contiguous``: the naive per-request contiguous reservation, for comparison (a variant).
- ``kv_cache_config`` + ``managers``: ``KVCacheConfig`` and ``create_kv_cache_manager``.
- ``integrity`` + ``errors``: the invariant checks and ``IntegrityError``.
- ``metrics``: the capacity figures.
- ``scheduler``: token-budget continuous batching on top of the manager; its rules live in
  ``step_plan`` (a step's budget, chunks, output), ``admission`` (validation, queue order,
  seats, headroom, hysteresis), ``preemption`` (victim, recompute vs swap) and
  ``stop_checks`` (appending a token, stop checks).
- ``step_cost`` / ``step_budget``: an online step cost model and the step-time budget that
  sizes prefill chunks with it (the scheduler calls it once a step).
"""

from kvserve.core.block_pool import NULL_BLOCK_ID, BlockPool, FreeBlockQueue, KVBlock
from kvserve.core.contiguous import ContiguousKVCacheManager
from kvserve.core.errors import IntegrityError
from kvserve.core.host_tier import HostBlock, HostTier
from kvserve.core.kv_cache_config import KVCacheConfig, KVWindow
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.managers import KV_CACHE_MANAGERS, create_kv_cache_manager
from kvserve.core.metrics import KVCacheCounters
from kvserve.core.prefix_cache import PrefixCache, RadixPrefixCache
from kvserve.core.window import WindowedKVCacheManager

__all__ = [
    "KV_CACHE_MANAGERS",
    "NULL_BLOCK_ID",
    "BlockPool",
    "ContiguousKVCacheManager",
    "FreeBlockQueue",
    "HostBlock",
    "HostTier",
    "IntegrityError",
    "KVBlock",
    "KVCacheConfig",
    "KVCacheCounters",
    "KVCacheManager",
    "KVWindow",
    "PrefixCache",
    "RadixPrefixCache",
    "WindowedKVCacheManager",
    "create_kv_cache_manager",
]
