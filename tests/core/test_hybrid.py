"""The hybrid KV cache: groups, per-group tables, window frees, prefix hits across groups."""

from __future__ import annotations

import pytest

from kvserve.core.kv.hybrid import HybridKVCacheManager
from kvserve.core.kv.hybrid_prefix import first_needed
from kvserve.core.kv.kv_groups import (
    KVGroupSpec,
    group_layers,
    hybrid_blocks_per_request,
    kv_slot_of_layers,
    window_blocks,
)
from tests.core.fake_runner import make_request

FULL, SLIDE = "full_attention", "sliding_attention"
NULL = -1


def test_group_layers_gemma3_pattern_and_uniform() -> None:
    types = [SLIDE] * 5 + [FULL] + [SLIDE] * 5 + [FULL]
    groups = group_layers(types, 8)
    assert groups[0] == KVGroupSpec((5, 11), None)  # full groups first
    assert [g.layers for g in groups[1:]] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    assert all(g.window == 8 for g in groups[1:])
    assert kv_slot_of_layers(groups, 12) == [0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 1]
    assert group_layers([FULL] * 3, None) == (KVGroupSpec((0, 1, 2)),)
    # 5 full and 6 sliding: within 1.25x, so one group per type (padding one slot).
    assert [len(g.layers) for g in group_layers([FULL] * 5 + [SLIDE] * 6, 4)] == [5, 6]


def test_group_layers_rejects_bad_types() -> None:
    with pytest.raises(ValueError, match="unknown layer_types"):
        group_layers([FULL, "chunked_attention"], 4)
    with pytest.raises(ValueError, match="no sliding_window"):
        group_layers([FULL, SLIDE], None)


def test_window_blocks_and_per_request_figure() -> None:
    assert window_blocks(8, 4) == 3  # ceil(8/4) + 1 for a decode
    assert window_blocks(8, 4, 9) == 5
    groups = (KVGroupSpec((1,)), KVGroupSpec((0,), 8))
    assert hybrid_blocks_per_request(groups, 4, 100) == 25 + 3
    assert hybrid_blocks_per_request(groups, 4, 5) == 2 + 2  # short: every block


def _kv(num_blocks: int = 32, **kw: object) -> HybridKVCacheManager:
    groups = (KVGroupSpec((1,)), KVGroupSpec((0,), 8))  # window 8, block size 4
    return HybridKVCacheManager(num_blocks, 4, groups, **kw)  # type: ignore[arg-type]


def _run(kv: HybridKVCacheManager, req, n: int) -> list[int] | None:  # type: ignore[no-untyped-def]
    got = kv.allocate_slots(req, n)
    if got is not None:
        kv.remove_skipped_blocks(req)
        req.num_computed_tokens += n
    kv.check_integrity()
    return got


def test_exact_block_ids_window_frees_and_bound() -> None:
    kv = _kv()
    r = make_request("a", list(range(10)), max_tokens=None)
    assert kv.allocate_slots(r, 10) == [0, 1, 2, 3, 4, 5]
    assert kv.get_group_block_ids("a") == [[0, 1, 2], [3, 4, 5]]
    assert kv.remove_skipped_blocks(r) == []  # nothing computed yet
    r.num_computed_tokens = 10
    kv.check_integrity()
    for t in range(10, 20):
        r.output_token_ids.append(100 + t)
        assert _run(kv, r, 1) is not None
        live = [b for b in kv.get_group_block_ids("a")[1] if b != NULL]
        assert len(live) <= window_blocks(8, 4)  # ceil(W / bs) + 1
    full, sliding = kv.get_group_block_ids("a")
    assert len(full) == len(sliding) == 5 and NULL not in full
    # Computed 20: the next query (position 20) reads 13..19, blocks 3 and 4 (block 5 for
    # position 20 itself once allocated); blocks 0..2 left the window.
    assert sliding[:3] == [NULL] * 3
    assert kv.num_window_freed_blocks == 3
    kv.free(r)
    kv.check_integrity()
    assert kv.num_free_blocks == 32


def test_allocation_is_all_or_nothing_across_groups() -> None:
    kv = _kv(num_blocks=5)
    r = make_request("a", list(range(8)))
    assert kv.allocate_slots(r, 8) == [0, 1, 2, 3]
    r.num_computed_tokens = 8
    r.output_token_ids.append(1)
    before = kv.dump_state()
    # Position 8 needs block 2 in both groups: 2 blocks, 1 free.
    assert kv.allocate_slots(r, 1) is None
    after = kv.dump_state()
    assert before["tables"] == after["tables"] and before["ref_cnts"] == after["ref_cnts"]
    kv.check_integrity()


def test_prefix_hit_needs_every_groups_blocks() -> None:
    kv = _kv()
    a = make_request("a", list(range(20)))
    _run(kv, a, 20)
    kv.remove_skipped_blocks(a)  # the next step's trim: computed 20
    full, sliding = kv.get_group_block_ids("a")
    assert sliding[:3] == [NULL] * 3 and NULL not in sliding[3:]
    kv.free(a)
    kv.check_integrity()
    # Same 20 tokens + 1: the hit is capped at 20 tokens (5 blocks); the sliding group must
    # hold blocks first_needed(5) = 3 .. 4 (positions 13..19), and it does.
    assert first_needed(5, 8, 4) == 3
    b = make_request("b", list(range(21)))
    ids, num = kv.get_computed_blocks(b)
    assert (ids, num) == (full, 20)
    assert kv.allocate_slots(b, 1, ids, num) is not None
    b.num_computed_tokens = 21
    kv.check_integrity()
    hit = kv.get_group_block_ids("b")
    assert hit[0][:5] == full
    assert hit[1][:5] == [NULL, NULL, NULL, *sliding[3:5]]
    assert kv.snapshot()["prefix_cache_hits"] == 20


@pytest.mark.parametrize(("filler_tokens", "hit_tokens"), [(12, 16), (16, 0)])
def test_no_hit_where_the_sliding_group_lost_its_blocks(
    filler_tokens: int, hit_tokens: int
) -> None:
    kv = _kv(num_blocks=12)
    a = make_request("a", list(range(16)))
    _run(kv, a, 16)
    assert kv.remove_skipped_blocks(a) == [4, 5]  # sliding blocks 0, 1 leave the window
    kv.free(a)
    # Free list: never-used 8..11, then the cached ones in the order they were freed:
    # sliding 5, 4, full 3, 2, 1, 0, sliding 7, 6.
    assert kv.block_pool.free_block_ids() == [8, 9, 10, 11, 5, 4, 3, 2, 1, 0, 7, 6]
    filler = make_request("f", [99] * filler_tokens)
    assert kv.allocate_slots(filler, filler_tokens) is not None
    kv.check_integrity()
    # 12 tokens evict sliding 5, 4 (positions 0..7): a hit of 16 tokens reads only 9..15.
    # 16 tokens also evict full 3, 2: the full group has 2 blocks, but the sliding group
    # lacks blocks 0 and 1, which hits of 1 or 2 blocks need: no hit at all.
    b = make_request("b", list(range(17)))
    ids, num = kv.get_computed_blocks(b)
    assert num == hit_tokens and len(ids) * 4 == num
    kv.free(filler)
    if num:
        assert kv.allocate_slots(b, 1, ids, num) is not None
        b.num_computed_tokens = 17
        kv.check_integrity()


def test_fork_copy_on_write_per_group_and_swap_round_trip() -> None:
    kv = _kv(num_host_blocks=16)
    p = make_request("p", list(range(6)))
    c = make_request("c", list(range(6)))
    _run(kv, p, 6)
    kv.fork(p, c)
    c.num_computed_tokens = 5
    kv.check_integrity()
    assert kv.allocate_slots(c, 1) == [4, 5]  # block 1 of each group: shared -> copied
    assert sorted(kv.take_pending_copies()) == [(1, 4), (3, 5)]
    c.num_computed_tokens = 6
    kv.check_integrity()
    # Swap the child out and back: every group's live blocks travel.
    pairs = kv.swap_out(c)
    assert pairs is not None and len(pairs) == 4
    assert kv.num_swapped_blocks(c) == 4
    kv.check_integrity()
    back = kv.swap_in(c)
    assert back is not None and sorted(h for h, _ in back) == sorted(h for _, h in pairs)
    kv.check_integrity()
    kv.free(c)
    kv.free(p)
    kv.check_integrity()
    assert kv.num_free_blocks == 32 and kv.num_free_host_blocks == 16


def test_swap_keeps_null_entries_of_the_window() -> None:
    kv = _kv(num_host_blocks=16)
    r = make_request("r", list(range(24)))
    _run(kv, r, 24)
    r.output_token_ids.append(7)
    _run(kv, r, 1)
    tables = kv.get_group_block_ids("r")
    pairs = kv.swap_out(r)
    assert pairs is not None
    assert len(pairs) == sum(b != NULL for t in tables for b in t)
    assert kv.swap_in(r) is not None
    got = kv.get_group_block_ids("r")
    assert [b == NULL for b in got[1]] == [b == NULL for b in tables[1]]
    kv.check_integrity()


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="host prefix"):
        _kv(enable_host_prefix_cache=True)
    kv = _kv()
    r = make_request("r", list(range(8)))
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        kv.allocate_slots(r, 1, [0], 3)
    with pytest.raises(ValueError, match="no longer in the prefix cache"):
        kv.allocate_slots(r, 1, [0], 4)
