"""/metrics exposes the host tier's hits, copy times and load-vs-recompute ratio."""

from __future__ import annotations

from kvserve.config import SchedulerConfig
from kvserve.core.kv.contiguous import ContiguousKVCacheManager
from kvserve.core.kv.kv_cache_config import KVWindow
from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.kv.metrics import HostTransferStats
from kvserve.core.kv.window import WindowedKVCacheManager
from kvserve.core.sched.scheduler import Scheduler
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.server.metrics import ServerMetrics


def test_host_tier_figures_are_exported_under_kvserve_names() -> None:
    metrics = ServerMetrics()
    metrics.set_engine_stats(
        {
            "device_hit_tokens": 544,
            "host_hit_tokens": 1040,
            "host_load_blocks": 65,
            "host_load_seconds": 0.07,
            "host_offload_blocks": 98,
            "host_offload_seconds": 0.2,
            "swap_in_seconds": 0.0,
            "swap_out_seconds": 0.0,
            "host_load_seconds_per_token": 6.9e-5,
            "prefill_seconds_per_token": 0.01,
            "host_tier_load_vs_recompute": 0.0069,
        }
    )
    text = metrics.render().decode()
    for line in (
        "kvserve:device_hit_tokens_total 544.0",
        "kvserve:host_hit_tokens_total 1040.0",
        "kvserve:host_load_blocks_total 65.0",
        "kvserve:host_load_seconds_total 0.07",
        "kvserve:host_offload_blocks_total 98.0",
        "kvserve:host_offload_seconds_total 0.2",
        "kvserve:swap_in_seconds_total 0.0",
        "kvserve:swap_out_seconds_total 0.0",
        "kvserve:host_load_seconds_per_token 6.9e-05",
        "kvserve:prefill_seconds_per_token 0.01",
        "kvserve:host_tier_load_vs_recompute 0.0069",
    ):
        assert line in text.splitlines(), line
    # A figure the engine does not report is left out, not exported as 0.
    metrics.set_engine_stats({})
    assert "host_load_seconds" not in metrics.render().decode()


def test_every_capacity_figure_of_stats_is_exported() -> None:
    # The capacity keys of the engine's stats() (DESIGN.md's table and the scheduler's
    # counters); each gets a distinct value that must appear under a kvserve: name.
    keys = """num_kv_blocks block_size kv_bytes_per_token num_free_blocks kv_usage kv_utilization
    fragmentation prefix_cache_queries prefix_cache_hits prefix_hit_rate prefix_cache_evictions
    cow_copies fork_shared_blocks swap_out_blocks swap_in_blocks num_host_blocks
    num_free_host_blocks offload_blocks load_blocks host_cache_evictions alloc_time_s
    alloc_calls preemptions preemptions_recompute preemptions_swap priority_preemptions
    recomputed_tokens_wasted max_concurrent_requests preemptions_per_1k_scheduled
    preempted_step_fraction admission_closed num_running num_waiting num_swapped
    num_failed_requests num_finished_requests num_aborted_requests num_steps
    schedule_time_s""".split()
    stats = {key: 1000.0 + i for i, key in enumerate(keys)}
    metrics = ServerMetrics()
    metrics.set_engine_stats(stats)
    values = set()
    for line in metrics.render().decode().splitlines():
        if line.startswith("kvserve:"):
            values.add(float(line.rsplit(" ", 1)[1]))
    missing = {k for k, v in stats.items() if v not in values}
    assert not missing, missing


def _exported(metrics: ServerMetrics) -> dict[str, tuple[str, float]]:
    """Every engine-stats sample of the page: name -> (TYPE of its family, value)."""
    types: dict[str, str] = {}
    samples: dict[str, tuple[str, float]] = {}
    for line in metrics.render().decode().splitlines():
        if line.startswith("# TYPE kvserve:"):
            _, _, name, kind = line.split()
            types[name] = kind
        elif line.startswith("kvserve:") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            family = name if name in types else name.removesuffix("_total")
            samples[name] = (types.get(family, "?"), float(value))
    return samples


def test_every_numeric_figure_of_the_figure_sources_is_exported() -> None:
    # The real sources of stats()' capacity figures: the scheduler (with the KV snapshot),
    # the host-transfer figures and the contiguous / windowed allocators' extra figures.
    kv = KVCacheManager(8, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), kv)
    stats: dict[str, float] = {**scheduler.stats(), **HostTransferStats().as_dict(4)}
    stats.update(ContiguousKVCacheManager(8, 4, max_model_len=16).snapshot())
    stats.update(WindowedKVCacheManager(8, 4, kv_window=KVWindow(4)).snapshot())
    stats = {key: 1000.0 + i for i, key in enumerate(sorted(stats))}
    metrics = ServerMetrics()
    metrics.set_engine_stats(stats)
    values = {v for _, v in _exported(metrics).values()}
    missing = {k for k, v in stats.items() if v not in values}
    assert not missing, missing


def test_figures_that_can_go_down_are_gauges_and_running_totals_counters() -> None:
    metrics = ServerMetrics()
    metrics.set_engine_stats(
        {
            # load tokens x the measured average prefill rate: the rate can fall
            "host_load_recompute_seconds": 1.5,
            "host_cache_blocks": 3,
            "schedule_time_per_step_s": 0.001,
            "largest_free_run_blocks": 4,
            "external_fragmentation": 0.5,
            "host_load_tokens": 64,
            "fragmented_alloc_failures": 2,
            "swap_fallbacks_to_recompute": 1,
        }
    )
    page = _exported(metrics)
    for gauge in (
        "host_load_recompute_seconds",
        "host_cache_blocks",
        "schedule_time_per_step_s",
        "largest_free_run_blocks",
        "external_fragmentation",
    ):
        assert page["kvserve:" + gauge][0] == "gauge", gauge
    for counter in ("host_load_tokens", "fragmented_alloc_failures", "swap_fallbacks_to_recompute"):
        assert page[f"kvserve:{counter}_total"][0] == "counter", counter


def test_tpot_is_a_histogram_observed_once_when_a_request_finishes() -> None:
    # DESIGN.md: ttft / tpot / itl / e2e are exported as histograms.
    metrics = ServerMetrics()

    def output(tokens: list[int], finished: bool) -> RequestOutput:
        done = CompletionOutput(index=0, text="", token_ids=tokens, delta_token_ids=tokens[-1:])
        m = RequestMetrics(arrival_time=0.0, ttft=0.2, tpot=0.05 if finished else None, e2e=None)
        return RequestOutput("r", None, [1], [done], finished=finished, metrics=m)

    for i in range(1, 4):
        metrics.on_output(output(list(range(i)), finished=i == 3))
    page = metrics.render().decode().splitlines()
    assert "kvserve:request_time_per_output_token_seconds_count 1.0" in page
    assert "kvserve:request_time_per_output_token_seconds_sum 0.05" in page


def test_speculative_decoding_figures_follow_vllm_names() -> None:
    metrics = ServerMetrics()
    metrics.set_engine_stats(
        {
            "spec_decode_num_drafts": 10,
            "spec_decode_num_draft_tokens": 30,
            "spec_decode_num_accepted_tokens": 12,
            "spec_decode_acceptance_rate": 0.4,
            "spec_decode_mean_acceptance_length": 2.2,
            "spec_decode_num_accepted_tokens_per_pos_0": 7,
            "spec_decode_num_accepted_tokens_per_pos_1": 5,
        }
    )
    lines = metrics.render().decode().splitlines()
    for line in (
        "kvserve:spec_decode_num_drafts_total 10.0",
        "kvserve:spec_decode_num_draft_tokens_total 30.0",
        "kvserve:spec_decode_num_accepted_tokens_total 12.0",
        "kvserve:spec_decode_acceptance_rate 0.4",
        "kvserve:spec_decode_mean_acceptance_length 2.2",
        'kvserve:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 7.0',
        'kvserve:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 5.0',
    ):
        assert line in lines, line
