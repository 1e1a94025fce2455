"""The KV cache manager variants and ``create_kv_cache_manager``, the one place that picks one.

========== ============================ ==================================================
kind       class                        what differs from the base (by hooks only)
========== ============================ ==================================================
paged      ``KVCacheManager``           the base: blocks on demand, prefix caching, CoW
windowed   ``WindowedKVCacheManager``   ``_skipped_blocks``: out-of-window blocks freed
contiguous ``ContiguousKVCacheManager`` ``_allocate_slots``: one run per request
========== ============================ ==================================================

A hybrid model's groups (``KVCacheConfig.kv_groups``) get ``HybridKVCacheManager``
(``hybrid.py``): the scheduler's interface over per-group tables, not a ``KVCacheManager``
variant.
"""

from __future__ import annotations

import dataclasses
import logging

from kvserve.core.kv.contiguous import ContiguousKVCacheManager
from kvserve.core.kv.hybrid import HybridKVCacheManager
from kvserve.core.kv.kv_cache_config import KVCacheConfig
from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.kv.window import WindowedKVCacheManager

logger = logging.getLogger("kvserve")

KV_CACHE_MANAGERS: dict[str, type[KVCacheManager]] = {
    "paged": KVCacheManager,
    "windowed": WindowedKVCacheManager,
    "contiguous": ContiguousKVCacheManager,
}


def create_kv_cache_manager(config: KVCacheConfig) -> KVCacheManager | HybridKVCacheManager:
    """Build the manager ``config.kind`` names.

    A variant that cannot cache prefixes (``prefix_caching_conflict``) gets prefix caching
    and the host prefix tier turned off, with a log line saying why, rather than an error:
    the engine's defaults ask for prefix caching. Raises ValueError for an unknown kind.
    """
    if config.kv_groups:
        return HybridKVCacheManager(
            config.num_blocks,
            config.block_size,
            config.kv_groups,
            enable_prefix_caching=config.enable_prefix_caching,
            num_host_blocks=config.num_host_blocks,
            max_chunk=config.max_num_batched_tokens,
        )
    cls = KV_CACHE_MANAGERS.get(config.kind)
    if cls is None:
        raise ValueError(
            f"unknown KV cache manager kind {config.kind!r}; one of {sorted(KV_CACHE_MANAGERS)}"
        )
    conflict = cls.prefix_caching_conflict
    if conflict is not None and (config.enable_prefix_caching or config.enable_host_prefix_cache):
        logger.info("%s KV cache: prefix caching is off (%s)", config.kind, conflict)
        config = dataclasses.replace(
            config, enable_prefix_caching=False, enable_host_prefix_cache=False
        )
    return cls.from_config(config)
