"""create_kv_cache_manager: one map picks the variant; variants differ only by hooks."""

from __future__ import annotations

import pytest

from kvserve.core import (
    KV_CACHE_MANAGERS,
    NULL_BLOCK_ID,
    ContiguousKVCacheManager,
    KVCacheConfig,
    KVCacheManager,
    KVWindow,
    WindowedKVCacheManager,
    create_kv_cache_manager,
)
from tests.core.fake_runner import make_request


def test_the_map_picks_the_class_and_passes_the_config() -> None:
    paged = create_kv_cache_manager(
        KVCacheConfig(16, 4, num_host_blocks=8, enable_host_prefix_cache=True)
    )
    assert type(paged) is KVCacheManager
    assert paged.enable_prefix_caching and paged.enable_host_prefix_cache
    assert (paged.num_blocks, paged.block_size, paged.num_host_blocks) == (16, 4, 8)

    windowed = create_kv_cache_manager(KVCacheConfig(16, 4, kv_window=KVWindow(8, 4)))
    assert type(windowed) is WindowedKVCacheManager
    assert windowed.kv_window == KVWindow(8, 4)

    contiguous = create_kv_cache_manager(
        KVCacheConfig(16, 4, allocator="contiguous", max_model_len=64)
    )
    assert type(contiguous) is ContiguousKVCacheManager
    assert contiguous.max_model_len == 64
    assert set(KV_CACHE_MANAGERS) == {"paged", "windowed", "contiguous"}


def test_a_variant_that_shares_no_blocks_gets_prefix_caching_off() -> None:
    # The engine's defaults ask for prefix caching: the factory turns it off, the class
    # itself refuses it.
    kv = create_kv_cache_manager(
        KVCacheConfig(16, 4, kv_window=KVWindow(8), enable_prefix_caching=True)
    )
    assert not kv.enable_prefix_caching and not kv.enable_host_prefix_cache
    with pytest.raises(ValueError, match="needs enable_prefix_caching=False"):
        WindowedKVCacheManager(16, 4, kv_window=KVWindow(8), enable_prefix_caching=True)


def test_bad_configs_are_named() -> None:
    with pytest.raises(ValueError, match="unknown KV cache manager kind 'buddy'"):
        create_kv_cache_manager(KVCacheConfig(16, 4, allocator="buddy"))
    with pytest.raises(ValueError, match="max_model_len"):
        create_kv_cache_manager(KVCacheConfig(16, 4, allocator="contiguous"))
    with pytest.raises(ValueError, match="kv_window"):
        WindowedKVCacheManager.from_config(KVCacheConfig(16, 4))


def test_full_attention_skips_nothing_and_the_null_block_costs_no_capacity() -> None:
    kv = KVCacheManager(8, 4)
    r = make_request("r", list(range(1, 30)), max_tokens=2)
    assert kv.allocate_slots(r, 29) is not None
    r.num_computed_tokens = 29
    assert kv.remove_skipped_blocks(r) == []
    assert NULL_BLOCK_ID not in kv.get_block_ids("r")
    null = kv.block_pool.null_block
    assert null is not None and null.block_id == NULL_BLOCK_ID
    assert null not in kv.block_pool.blocks and kv.block_pool.num_usable_blocks == 8
    kv.check_integrity()
