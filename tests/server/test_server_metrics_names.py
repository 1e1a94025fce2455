"""/metrics exposes the host tier's hits, copy times and load-vs-recompute ratio."""

from __future__ import annotations

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
