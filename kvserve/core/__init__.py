"""The memory core: pure Python, no torch. Every test here runs in milliseconds.

- ``kv/``: block pool, radix prefix cache, block tables, the KV cache manager and its
  variants (windowed, contiguous), the host tier and swap space, integrity checks, metrics.
- ``sched/``: the token-budget scheduler: step plan, admission, preemption, policies,
  stop checks, the step-cost model and step-time budget.
- ``outputs``: ``SchedulerOutput`` / ``ModelRunnerOutput``, the only types that cross to
  the runner; ``errors``: ``IntegrityError``.
"""

from kvserve.core.errors import IntegrityError
from kvserve.core.kv.block_pool import NULL_BLOCK_ID, BlockPool, FreeBlockQueue, KVBlock
from kvserve.core.kv.contiguous import ContiguousKVCacheManager
from kvserve.core.kv.host_tier import HostBlock, HostTier
from kvserve.core.kv.kv_cache_config import KVCacheConfig, KVWindow
from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.kv.managers import KV_CACHE_MANAGERS, create_kv_cache_manager
from kvserve.core.kv.metrics import KVCacheCounters
from kvserve.core.kv.prefix_cache import PrefixCache, RadixPrefixCache
from kvserve.core.kv.window import WindowedKVCacheManager

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
