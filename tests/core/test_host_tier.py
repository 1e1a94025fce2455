"""Host offload tier of the prefix cache: exact block ids, pins, eviction order, and the
scheduler end to end on the FakeRunner (which checks every K/V slot it reads)."""

from __future__ import annotations

import random

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.kv.host_tier import HostTier
from kvserve.core.kv.kv_cache_manager import KVCacheManager, host_block_ref
from kvserve.core.sched.scheduler import Scheduler
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from tests.core.fake_runner import (
    Driver,
    FakeClock,
    FakeRunner,
    assert_pool_idle,
    expected_output,
    make_request,
)
from tests.core.test_scheduler_liveness import VOCAB, random_workload

PARAMS = SamplingParams(max_tokens=None)


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), PARAMS)


def tier(num_blocks: int, block_size: int, num_host_blocks: int) -> KVCacheManager:
    return KVCacheManager(
        num_blocks, block_size, num_host_blocks=num_host_blocks, enable_host_prefix_cache=True
    )


def admit(kv: KVCacheManager, r: Request) -> list[int]:
    """get_computed_blocks + first allocate_slots for the whole request, then 'run' it."""
    ids, num_hit = kv.get_computed_blocks(r)
    new = kv.allocate_slots(r, r.num_tokens - num_hit, ids, num_hit)
    assert new is not None
    r.num_computed_tokens = r.num_tokens
    kv.check_integrity()
    return new


A = list(range(12)) + [99]  # three full blocks of 4, one partial
B = list(range(50, 62)) + [98]


def test_evicted_blocks_are_offloaded_and_loaded_back_on_a_hit() -> None:
    kv = tier(4, 4, 8)
    a = req("a", A)
    assert admit(kv, a) == [0, 1, 2, 3]
    kv.free(a)
    assert kv.block_pool.free_block_ids() == [3, 2, 1, 0]  # partial first, then tail first
    b = req("b", B)
    assert admit(kv, b) == [3, 2, 1, 0]  # evicts a's cached blocks 2, 1, 0 (tail first)
    assert kv.take_pending_swaps() == ([(2, 0), (1, 1), (0, 2)], [])
    assert kv.host_tier.num_cached_blocks == 3 and kv.num_free_host_blocks == 8
    kv.check_integrity()
    kv.free(b)
    c = req("c", A)  # same prompt as a: all three full blocks are in the host tier
    assert kv.get_computed_blocks(c) == ([host_block_ref(2), host_block_ref(1), -1], 12)
    assert admit(kv, c) == [0, 1, 2, 3]  # three loads + one block for the last token
    offloads, loads = kv.take_pending_swaps()
    assert loads == [(2, 0), (1, 1), (0, 2)]
    # b's cached blocks 1, 2, 3 (device) were offloaded to make room (host 3, 4, 5).
    assert offloads == [(1, 3), (2, 4), (3, 5)]
    assert kv.get_computed_blocks(req("d", A)) == ([0, 1, 2], 12)  # device-resident again
    snap = kv.snapshot()
    assert (snap["host_hit_tokens"], snap["device_hit_tokens"], snap["prefix_cache_hits"]) == (
        12,
        0,
        12,
    )
    assert (snap["offload_blocks"], snap["load_blocks"], snap["host_cache_blocks"]) == (6, 3, 3)
    assert snap["prefix_hit_rate"] == pytest.approx(12 / 39)
    kv.check_integrity()


def test_host_lru_evicts_the_oldest_offload_a_leaf_first() -> None:
    kv = tier(4, 4, 3)
    a = req("a", A)
    admit(kv, a)
    kv.free(a)
    b = req("b", B)
    admit(kv, b)  # a's path -> host 0 (block 2), 1, 2 (block 0: the root's child)
    kv.take_pending_swaps()
    kv.free(b)
    c = req("c", list(range(100, 112)) + [97])
    admit(kv, c)  # b's path is offloaded: host blocks come from a's path, leaf first
    offloads, loads = kv.take_pending_swaps()
    assert loads == [] and offloads == [(1, 0), (2, 1), (3, 2)]
    assert kv.snapshot()["host_cache_evictions"] == 3
    assert kv.get_computed_blocks(req("x", A)) == ([], 0)  # a's path is gone entirely
    got, num = kv.get_computed_blocks(req("y", B))
    assert (got, num) == ([-3, -2, -1], 12)
    kv.check_integrity()


def test_without_a_host_block_an_evicted_block_is_dropped_with_its_host_subtree() -> None:
    kv = tier(4, 4, 3)
    s = req("s", list(range(200, 212)))
    admit(kv, s)
    assert kv.swap_out(s) == [(0, 0), (1, 1), (2, 2)]  # the host tier is full of s
    kv.take_pending_swaps()
    a = req("a", A)
    admit(kv, a)  # evicts s's device copies: no host block to offload into
    assert kv.take_pending_swaps() == ([], [])
    assert kv.num_swapped_blocks(s) == 3 and kv.host_tier.num_cached_blocks == 0
    kv.free(s)  # host tier free again
    kv.free(a)
    assert kv.block_pool.free_block_ids() == [0, 1, 2, 3]  # a = [3, 2, 1, 0], tail first
    b = req("b", B)
    admit(kv, b)  # a's tail 1 -> host 0, 2 -> host 1, head 3 -> host 2
    assert kv.take_pending_swaps() == ([(1, 0), (2, 1), (3, 2)], [])
    kv.free(b)
    s2 = req("s2", list(range(300, 312)))
    admit(kv, s2)
    # Host tier full of a's path (unpinned, evictable): b's cached blocks 2, 1 are
    # offloaded by evicting a's oldest offloads (host 0, then 1: leaves first).
    assert kv.take_pending_swaps() == ([(2, 0), (1, 1)], [])
    assert kv.get_computed_blocks(req("x", A)) == ([host_block_ref(2)], 4)
    b_hits = [0, host_block_ref(1), host_block_ref(0)]  # device head, then host-resident
    assert kv.get_computed_blocks(req("y", B)) == (b_hits, 12)
    kv.check_integrity()


def test_a_loaded_host_block_is_not_reused_in_the_same_step() -> None:
    kv = tier(3, 4, 3)
    a = req("a", A[:8] + [99])  # two full blocks + one partial
    admit(kv, a)
    kv.free(a)
    b = req("b", B[:8] + [98])
    admit(kv, b)  # a's blocks 1, 0 -> host 0, 1
    kv.take_pending_swaps()
    kv.free(b)
    c = req("c", A[:8] + [77])
    assert kv.get_computed_blocks(c) == ([host_block_ref(1), host_block_ref(0)], 8)
    # The allocation evicts b's blocks 1, 2: block 1 is offloaded to host 2, the only one
    # free (0 and 1 are read in this step's swap-in phase); then nothing is left (host 2
    # was written in this step), so b's head 2 is dropped with its host child.
    admit(kv, c)
    assert kv.take_pending_swaps() == ([(1, 2)], [(1, 0), (0, 1)])
    assert kv.get_computed_blocks(req("x", B[:8] + [98])) == ([], 0)
    assert kv.snapshot()["host_cache_evictions"] == 1
    kv.check_integrity()


def test_swap_in_sources_are_pinned_until_the_plans_are_taken() -> None:
    kv = tier(4, 4, 4)
    s = req("s", list(range(200, 208)) + [1])
    admit(kv, s)
    kv.swap_out(s)  # host 0, 1, 2
    kv.take_pending_swaps()
    a = req("a", A)
    admit(kv, a)  # evicts s's cached blocks 1, 0 -> host 3 and... only one free host block
    kv.take_pending_swaps()
    kv.free(a)
    assert kv.swap_in(s) == [(0, 0), (1, 1), (2, 3)]
    # The swap-in released host 0..2, but they are read in this step's swap-in phase: no
    # plan of this step may write them. Its allocation offloaded a's block 1 to host 3.
    assert kv.num_free_host_blocks == 0 and kv.host_tier.deferred_ids == [3, 2, 1, 0]
    kv.check_integrity()
    assert kv.allocate_slots(req("d", B), 1) == [2]  # evicts a's head: dropped, no room
    assert kv.take_pending_swaps() == ([(1, 3)], [])
    assert kv.num_free_host_blocks == 4  # the pins ended with the step
    kv.check_integrity()


def test_swap_out_evicts_offloaded_blocks_but_never_swapped_ones() -> None:
    kv = tier(4, 4, 4)
    a = req("a", A)
    admit(kv, a)
    kv.free(a)
    s = req("s", list(range(200, 212)) + [1])
    admit(kv, s)  # a -> host 0, 1, 2
    kv.take_pending_swaps()
    assert kv.num_free_host_blocks == 4
    # s = [3, 2, 1, 0]: host 3 is free, then a's offloads are evicted (host 0, 1, 2).
    assert kv.swap_out(s) == [(3, 3), (2, 0), (1, 1), (0, 2)]
    kv.take_pending_swaps()
    assert kv.host_tier.num_cached_blocks == 0 and kv.num_free_host_blocks == 0
    t = req("t", list(range(300, 316)))
    admit(kv, t)
    assert kv.swap_out(t) is None  # only s's pinned-forever blocks: no room
    kv.check_integrity()


def test_swap_out_refuses_a_request_with_a_load_pending() -> None:
    kv = tier(4, 4, 4)
    a = req("a", A)
    admit(kv, a)
    kv.free(a)
    admit(kv, req("b", B))
    kv.take_pending_swaps()
    kv.free(kv._tables["b"].request)
    c = req("c", A)
    admit(kv, c)
    with pytest.raises(ValueError, match="host load pending"):
        kv.swap_out(c)
    kv.take_pending_swaps()
    assert kv.swap_out(c) is not None


def test_reset_prefix_cache_forgets_the_host_tier_too() -> None:
    kv = tier(4, 4, 4)
    a = req("a", A)
    admit(kv, a)
    kv.free(a)
    b = req("b", B)
    admit(kv, b)
    kv.take_pending_swaps()
    kv.free(b)
    assert kv.host_tier.num_cached_blocks == 3
    assert kv.reset_prefix_cache()
    assert kv.host_tier.num_cached_blocks == 0 and kv.num_free_host_blocks == 4
    assert kv.get_computed_blocks(req("c", A)) == ([], 0)
    kv.check_integrity()


def test_bad_options_and_references_raise() -> None:
    with pytest.raises(ValueError, match="needs a host tier"):
        KVCacheManager(4, 4, enable_host_prefix_cache=True)
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        KVCacheManager(
            4, 4, num_host_blocks=2, enable_prefix_caching=False, enable_host_prefix_cache=True
        )
    with pytest.raises(ValueError, match="num_host_blocks"):
        HostTier(-1, step_pins=False)
    kv = tier(4, 4, 2)
    with pytest.raises(ValueError, match="is not a block id"):
        kv.allocate_slots(req("a", A), 1, [-3], 4)  # host 2 does not exist
    with pytest.raises(ValueError, match="no longer in the prefix cache"):
        kv.allocate_slots(req("a", A), 1, [-1], 4)  # host 0 holds nothing


def test_check_integrity_catches_a_host_parent_of_a_device_block() -> None:
    kv = tier(4, 4, 4)
    a = req("a", A)
    admit(kv, a)
    kv.free(a)
    admit(kv, req("b", B[:5]))  # blocks 3, 2: evicts a's tail block 2 only -> host 0
    kv.take_pending_swaps()
    kv.check_integrity()
    block1, host0 = kv.block_pool.blocks[1], kv.host_tier.blocks[0]
    kv.prefix_cache.replace(block1, kv.host_tier.blocks[3])  # a host parent above ...
    kv.prefix_cache.replace(host0, block1)  # ... a device child
    with pytest.raises(AssertionError, match="host-resident parent"):
        kv.check_integrity()


# ---------------------------------------------------------------- scheduler end to end


def _conversations(num_conv: int, num_turns: int, rng: random.Random) -> list[list[list[int]]]:
    """Per conversation, the prompt of each turn: the previous prompt plus new tokens."""
    out = []
    for _ in range(num_conv):
        turns, history = [], [rng.randrange(VOCAB) for _ in range(10)]
        for _ in range(num_turns):
            history = history + [rng.randrange(VOCAB) for _ in range(rng.randint(3, 9))]
            turns.append(list(history))
        out.append(turns)
    return out


def _run_turns(kv: KVCacheManager, mode: str = "recompute") -> tuple[dict, dict[str, list[int]]]:
    """Multi-turn chat: every conversation's turn t runs after all turns t-1 finished; each
    turn re-sends the history with the previous answer appended. Returns (stats, outputs)."""
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=256,
        admission_headroom=0.0,
        resume_watermark=0.0,
        preemption_mode=mode,  # type: ignore[arg-type]
    )
    clock = FakeClock()
    scheduler = Scheduler(config, kv, clock=clock)
    runner = FakeRunner(kv.num_blocks, kv.block_size, kv.num_host_blocks, VOCAB)
    driver = Driver(scheduler, runner, clock)
    convs = _conversations(6, 3, random.Random(7))
    answers: list[list[int]] = [[] for _ in convs]
    outputs: dict[str, list[int]] = {}
    for turn in range(3):
        reqs = []
        for i, turns in enumerate(convs):
            r = make_request(f"c{i}t{turn}", turns[turn] + answers[i], max_tokens=4)
            scheduler.add_request(r)
            reqs.append(r)
        driver.run()
        for i, r in enumerate(reqs):
            assert r.status == RequestStatus.FINISHED_LENGTH
            assert r.output_token_ids == expected_output(r, scheduler, VOCAB), r.request_id
            answers[i] = answers[i] + r.output_token_ids
            outputs[r.request_id] = list(r.output_token_ids)
    assert_pool_idle(kv)
    return scheduler.stats(), outputs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_multi_turn_history_beyond_the_pool_hits_in_the_host_tier(mode: str) -> None:
    off_stats, off_out = _run_turns(KVCacheManager(16, 4, num_host_blocks=40), mode)
    on_stats, on_out = _run_turns(tier(16, 4, 40), mode)
    assert on_out == off_out
    assert on_stats["host_hit_tokens"] > 0 and on_stats["load_blocks"] > 0
    assert on_stats["prefix_hit_rate"] > off_stats["prefix_hit_rate"]
    assert off_stats["host_hit_tokens"] == off_stats["offload_blocks"] == 0
    assert on_stats["prefix_cache_hits"] == (
        on_stats["device_hit_tokens"] + on_stats["host_hit_tokens"]
    )


def test_random_workloads_with_the_tier_are_exact() -> None:
    """The liveness workloads (preemption, aborts, n > 1, chunking) with a tiny host tier
    shared by swapping and offloading: every output matches the oracle, nothing leaks."""
    rng = random.Random("host-tier")
    num_loads = 0
    for k in range(12):
        mode = "swap" if k % 2 else "recompute"
        w = random_workload(rng, mode)
        num_host = rng.choice([1, 2, w.num_blocks, 3 * w.num_blocks])
        kv = tier(w.num_blocks, w.block_size, num_host)
        config = SchedulerConfig(**w.config)
        clock = FakeClock()
        scheduler = Scheduler(config, kv, clock=clock)
        driver = Driver(scheduler, FakeRunner(w.num_blocks, w.block_size, num_host, VOCAB), clock)
        reqs = {}
        for spec in w.specs:
            r = spec.build()
            scheduler.add_request(r)
            reqs.update({x.request_id: x for x in (r, *r.pending_children)})
        driver.run()
        for rid, r in reqs.items():
            assert r.output_token_ids == expected_output(r, scheduler, VOCAB), rid
        assert_pool_idle(kv)
        num_loads += kv.snapshot()["load_blocks"]
    assert num_loads > 0, "no workload loaded a block back from the host tier"


def test_a_block_swapped_in_this_step_is_not_swapped_for_its_twin_until_written() -> None:
    """b's copies of a's blocks were swapped out while duplicates; a's blocks went to the
    host tier. In one step b is swapped back in (restore copies into 0, 1, 6) and d loads
    a's blocks back (5, 4): b's restored blocks are not written yet, so b keeps them until
    the step has run, then takes d's."""
    kv = tier(7, 4, 8)
    t = list(range(8))
    a = req("a", t + [1])
    admit(kv, a)
    b = req("b", t + [2])
    assert kv.allocate_slots(b, 9) == [3, 4, 5]  # the same step as a: duplicates of 0, 1
    b.num_computed_tokens = 9
    kv.swap_out(b)
    kv.take_pending_swaps()
    kv.free(a)
    c = req("c", list(range(100, 128)))
    admit(kv, c)  # evicts a's blocks 1, 0 to the host tier
    kv.free(c)
    kv.take_pending_swaps()
    assert kv.swap_in(b) == [(0, 0), (1, 1), (2, 6)]  # a's blocks are host-resident: copied
    d = req("d", t + [3])
    assert admit(kv, d) == [5, 4, 3]  # loads a's blocks into 5 and 4
    b.output_token_ids.extend([7, 8, 9])
    assert kv.allocate_slots(b, 3) == []
    b.num_computed_tokens = 12
    assert kv.get_block_ids("b") == [0, 1, 6] and kv.snapshot()["dedup_blocks"] == 0
    kv.check_integrity()
    kv.take_pending_copies()
    kv.take_pending_swaps()  # the step has run
    b.output_token_ids.extend([1, 2, 3, 4])
    assert kv.allocate_slots(b, 4) == [2]
    assert kv.get_block_ids("b") == [5, 4, 6, 2] and kv.snapshot()["dedup_blocks"] == 2
    kv.check_integrity()
