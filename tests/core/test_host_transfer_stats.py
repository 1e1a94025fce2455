"""HostTransferStats: measured copy times split by cause, and load vs recompute."""

from __future__ import annotations

import pytest

from kvserve.core.kv.metrics import HostTransferStats, KVCacheCounters
from kvserve.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from kvserve.sampling_params import SamplingParams

BLOCK_SIZE = 16


def _req(rid: str, num_tokens: int) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=rid,
        token_ids=[1] * num_tokens,
        start_pos=0,
        block_ids=[0],
        sample=True,
        sampling_params=SamplingParams(),
        prompt_token_ids=[1],
        output_token_ids=[],
    )


def _step(
    stats: HostTransferStats,
    counters: KVCacheCounters,
    *,
    scheduled: list[ScheduledRequest] = (),  # type: ignore[assignment]
    num_in: int = 0,
    num_out: int = 0,
    loads: int = 0,
    offloads: int = 0,
    swap_in_time: float = 0.0,
    swap_out_time: float = 0.0,
    execute_time: float = 0.0,
) -> None:
    """One step: the manager planned ``loads`` / ``offloads`` of the copied pairs."""
    counters.load_blocks += loads
    counters.offload_blocks += offloads
    sched = SchedulerOutput(
        scheduled=list(scheduled),
        blocks_to_swap_in=[(i, i) for i in range(num_in)],
        blocks_to_swap_out=[(i, i) for i in range(num_out)],
    )
    out = ModelRunnerOutput(
        execute_time=execute_time, swap_in_time=swap_in_time, swap_out_time=swap_out_time
    )
    stats.record(sched, out, counters)


def test_idle_engine_reports_zeros_not_nan() -> None:
    figures = HostTransferStats().as_dict(BLOCK_SIZE)
    assert all(v == 0 for v in figures.values()), figures


def test_copy_time_is_split_between_the_prefix_tier_and_preemption() -> None:
    stats, counters = HostTransferStats(), KVCacheCounters()
    # 3 swapped-in blocks of a preempted request + 1 prefix load; 2 offloads + 2 swap-outs.
    _step(stats, counters, num_in=4, loads=1, swap_in_time=0.8, num_out=4, offloads=2,
          swap_out_time=0.4)  # fmt: skip
    assert (stats.load_blocks, stats.swap_in_blocks) == (1, 3)
    assert (stats.offload_blocks, stats.swap_out_blocks) == (2, 2)
    assert stats.load_seconds == pytest.approx(0.2)
    assert stats.swap_in_seconds == pytest.approx(0.6)
    assert stats.offload_seconds == pytest.approx(0.2)
    assert stats.swap_out_seconds == pytest.approx(0.2)
    # Only counter changes since the last record() count: a step of pure preemption swaps.
    _step(stats, counters, num_in=2, swap_in_time=0.5)
    assert (stats.load_blocks, stats.swap_in_blocks) == (1, 5)
    assert stats.load_seconds == pytest.approx(0.2)
    assert stats.swap_in_seconds == pytest.approx(1.1)


def test_prefill_rate_comes_from_steps_that_computed_prefill_tokens() -> None:
    stats, counters = HostTransferStats(), KVCacheCounters()
    # A decode-only step does not count; a step's copy time is not forward time.
    _step(stats, counters, scheduled=[_req("d", 1)], execute_time=5.0)
    _step(stats, counters, scheduled=[_req("p", 30), _req("d", 1)], num_in=2, loads=2,
          swap_in_time=0.1, execute_time=3.2)  # fmt: skip
    _step(stats, counters, scheduled=[_req("q", 9)], execute_time=1.0)
    assert stats.prefill_step_tokens == 31 + 9
    assert stats.prefill_seconds == pytest.approx(3.1 + 1.0)
    figures = stats.as_dict(BLOCK_SIZE)
    rate = 4.1 / 40
    assert figures["prefill_seconds_per_token"] == pytest.approx(rate)
    assert figures["host_load_tokens"] == 2 * BLOCK_SIZE
    assert figures["host_load_seconds_per_token"] == pytest.approx(0.1 / 32)
    assert figures["host_load_recompute_seconds"] == pytest.approx(32 * rate)
    assert figures["host_tier_load_vs_recompute"] == pytest.approx(0.1 / (32 * rate))


def test_loads_beyond_the_copied_pairs_are_clamped() -> None:
    # A manager whose counters ran ahead of the step (e.g. a fresh stats object) never
    # makes more loads than the step copied, nor negative preemption time.
    stats, counters = HostTransferStats(), KVCacheCounters(load_blocks=10)
    _step(stats, counters, num_in=2, loads=1, swap_in_time=0.3)
    assert (stats.load_blocks, stats.swap_in_blocks) == (2, 0)
    assert stats.load_seconds == pytest.approx(0.3)
    assert stats.swap_in_seconds == pytest.approx(0.0)
