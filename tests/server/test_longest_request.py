"""How long a request without max_tokens may run (``context.longest_request``): the KV pool's
tokens for full attention, ``max_model_len`` for a windowed pool whose requests hold few
enough blocks at once."""

from __future__ import annotations

from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.kv.window import KVWindow, WindowedKVCacheManager
from kvserve.server.context import longest_request


def test_full_attention_stops_at_the_pool() -> None:
    kv = KVCacheManager(16, 16, enable_prefix_caching=False)
    assert longest_request(512, kv) == 256
    assert longest_request(100, kv) == 100


def test_a_windowed_pool_runs_to_max_model_len() -> None:
    win = KVWindow(32, 4)
    # sinks 1 block + (2 x 64 + 30) // 16 + 2 = 12 blocks at once, in a 16-block pool
    kv = WindowedKVCacheManager(16, 16, kv_window=win, max_chunk=64)
    assert kv.max_live_blocks(512) == 12
    assert longest_request(512, kv) == 512
    # with a 512-token step budget a request may hold 68 blocks at once: the pool binds
    kv = WindowedKVCacheManager(16, 16, kv_window=win, max_chunk=512)
    assert longest_request(512, kv) == 256
