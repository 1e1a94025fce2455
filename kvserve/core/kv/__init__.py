"""The KV memory core (no torch): block ids, tables, prefix cache, host tier, integrity.

- ``block_pool``: physical block ids, ref counts, the O(1) eviction-ordered free list.
- ``prefix_cache``: the ``PrefixCache`` interface and its radix-tree implementation.
- ``kv_cache_manager``: block tables, prefix hits, copy-on-write, fork, swap plans; the
  protected hooks its variants override. ``block_tables`` / ``tables``: the per-request records.
- ``slot_plan``: what an ``allocate_slots`` call or a swap-in needs, planned before any change.
- ``prefix_hits``: resolving prefix hits, caching and forgetting full blocks (tables <-> cache).
- ``host_tier``: host-memory block ids shared by swap preemption and the prefix offload
  tier; ``host_prefix``: the host prefix tier; ``swap_space``: swapped-out requests.
- ``window``: windowed eviction with attention sinks (a KVCacheManager variant).
- ``contiguous``: the naive per-request contiguous reservation, for comparison (a variant).
- ``kv_cache_config`` + ``managers``: ``KVCacheConfig`` and ``create_kv_cache_manager``.
- ``integrity``: the invariant checks; ``metrics``: the capacity figures.
"""
