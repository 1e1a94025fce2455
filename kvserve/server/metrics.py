"""Prometheus metrics (``kvserve:`` prefix) on a per-app CollectorRegistry.

Engine figures (running / waiting / swapped requests, KV usage, prefix cache hits per tier,
preemptions, token counts, host-tier copy times and load vs recompute) come from
``engine.stats()`` taken when /metrics is scraped; latency histograms are observed here from
the outputs the async engine routes to live requests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.outputs import RequestOutput

PREFIX = "kvserve:"

# (metric name, stats keys tried in order, help)
_GAUGES: list[tuple[str, tuple[str, ...], str]] = [
    ("num_requests_running", ("num_running",), "Requests in the RUNNING state"),
    ("num_requests_waiting", ("num_waiting",), "Requests waiting to be scheduled"),
    ("num_requests_swapped", ("num_swapped",), "Requests swapped out to the host tier"),
    ("kv_usage", ("kv_usage",), "KV blocks referenced by live requests / total blocks"),
    ("kv_utilization", ("kv_utilization",), "Tokens stored / (allocated blocks x block_size)"),
    (
        "host_load_seconds_per_token",
        ("host_load_seconds_per_token",),
        "Measured seconds per token loading host-tier prefix blocks to the device",
    ),
    (
        "prefill_seconds_per_token",
        ("prefill_seconds_per_token",),
        "Measured forward seconds per token of steps that computed prefill tokens",
    ),
    (
        "host_tier_load_vs_recompute",
        ("host_tier_load_vs_recompute",),
        "Host-tier load time / the prefill time the loaded tokens would have cost (< 1: cheaper)",
    ),
    # Capacity figures of stats() (DESIGN.md's table), by their stats() names.
    ("num_kv_blocks", ("num_kv_blocks",), "KV blocks in the device pool"),
    ("block_size", ("block_size",), "Tokens per KV block"),
    ("kv_bytes_per_token", ("kv_bytes_per_token",), "KV cache bytes per token, all layers"),
    ("num_free_blocks", ("num_free_blocks",), "Free KV blocks (cached-but-free included)"),
    ("fragmentation", ("fragmentation",), "1 - kv_utilization: internal waste of blocks"),
    ("prefix_hit_rate", ("prefix_hit_rate",), "Prefix-cache hit tokens / tokens looked up"),
    ("max_concurrent_requests", ("max_concurrent_requests",), "Peak RUNNING requests"),
    (
        "preemptions_per_1k_scheduled",
        ("preemptions_per_1k_scheduled",),
        "Preemption rate: preemptions per 1,000 scheduled request-steps",
    ),
    (
        "preempted_step_fraction",
        ("preempted_step_fraction",),
        "Fraction of steps that preempted a request",
    ),
    ("admission_closed", ("admission_closed",), "1 while admission waits for free blocks"),
    ("num_host_blocks", ("num_host_blocks",), "Blocks of the host tier"),
    ("num_free_host_blocks", ("num_free_host_blocks",), "Free blocks of the host tier"),
    ("host_cache_blocks", ("host_cache_blocks",), "Prefix blocks cached in the host tier"),
    (
        "schedule_time_per_step_s",
        ("schedule_time_per_step_s",),
        "Mean seconds in the scheduler per step",
    ),
    # NOTE: a gauge although it grows with the loads: loaded tokens x the measured average
    # prefill rate, which can fall, so the value can go down (a counter would break rate()).
    (
        "host_load_recompute_seconds",
        ("host_load_recompute_seconds",),
        "Prefill seconds the host-tier loaded tokens would have cost at the measured rate",
    ),
    # Speculative decoding: derived from the counters below (vLLM logs these two).
    (
        "spec_decode_acceptance_rate",
        ("spec_decode_acceptance_rate",),
        "Accepted draft tokens / draft tokens",
    ),
    (
        "spec_decode_mean_acceptance_length",
        ("spec_decode_mean_acceptance_length",),
        "Tokens per verification: 1 + accepted draft tokens / drafts",
    ),
    # --kv-allocator contiguous only
    ("largest_free_run_blocks", ("largest_free_run_blocks",), "Longest run of free blocks"),
    (
        "external_fragmentation",
        ("external_fragmentation",),
        "1 - largest free run / free blocks",
    ),
]
_COUNTERS: list[tuple[str, tuple[str, ...], str]] = [
    ("prefix_cache_queries", ("prefix_cache_queries",), "Prompt tokens looked up"),
    ("prefix_cache_hits", ("prefix_cache_hits",), "Prompt tokens served from the prefix cache"),
    ("num_preemptions", ("preemptions", "num_preemptions"), "Requests preempted for memory"),
    ("prefix_cache_evictions", ("prefix_cache_evictions",), "Cached blocks evicted"),
    ("prompt_tokens", ("num_prompt_tokens",), "Prompt tokens of accepted requests"),
    ("generation_tokens", ("num_generation_tokens",), "Generated tokens"),
    ("device_hit_tokens", ("device_hit_tokens",), "Prefix-cache hit tokens on the device"),
    ("host_hit_tokens", ("host_hit_tokens",), "Prefix-cache hit tokens loaded from the host"),
    ("host_load_blocks", ("host_load_blocks",), "Host-tier prefix blocks loaded to the device"),
    ("host_load_seconds", ("host_load_seconds",), "Seconds loading host-tier prefix blocks"),
    ("host_offload_blocks", ("host_offload_blocks",), "Evicted prefix blocks saved to the host"),
    ("host_offload_seconds", ("host_offload_seconds",), "Seconds saving prefix blocks to host"),
    ("swap_in_seconds", ("swap_in_seconds",), "Seconds swapping preempted requests back in"),
    ("swap_out_seconds", ("swap_out_seconds",), "Seconds swapping preempted requests out"),
    # Capacity counters of stats(), by their stats() names.
    ("cow_copies", ("cow_copies",), "Blocks copied by copy-on-write"),
    ("fork_shared_blocks", ("fork_shared_blocks",), "Blocks shared by n > 1 forks"),
    ("dedup_blocks", ("dedup_blocks",), "Duplicate blocks swapped for their cached twin"),
    ("swap_out_blocks", ("swap_out_blocks",), "Blocks swapped out by swap preemption"),
    ("swap_in_blocks", ("swap_in_blocks",), "Blocks swapped back in"),
    ("offload_blocks", ("offload_blocks",), "Evicted prefix blocks copied to the host tier"),
    ("load_blocks", ("load_blocks",), "Host-tier prefix blocks loaded back"),
    ("host_cache_evictions", ("host_cache_evictions",), "Host-tier prefix blocks dropped"),
    ("alloc_seconds", ("alloc_time_s",), "Seconds spent allocating KV blocks"),
    ("alloc_calls", ("alloc_calls",), "KV block allocation calls"),
    ("preemptions_recompute", ("preemptions_recompute",), "Preemptions by recompute"),
    ("preemptions_swap", ("preemptions_swap",), "Preemptions by swap"),
    ("priority_preemptions", ("priority_preemptions",), "Preemptions for a higher priority"),
    (
        "recomputed_tokens_wasted",
        ("recomputed_tokens_wasted",),
        "Tokens a request computed and lost to a recompute preemption (prefix hits excluded)",
    ),
    ("failed_requests", ("num_failed_requests",), "Requests failed by a fault of their own"),
    ("finished_requests", ("num_finished_requests",), "Samples finished (any reason)"),
    ("aborted_requests", ("num_aborted_requests",), "Samples aborted (or failed)"),
    ("steps", ("num_steps",), "Engine steps"),
    ("schedule_seconds", ("schedule_time_s",), "Seconds spent in the scheduler"),
    ("host_load_tokens", ("host_load_tokens",), "Tokens of host-tier prefix blocks loaded"),
    ("num_scheduled_requests", ("num_scheduled_requests",), "Scheduled request-steps"),
    ("num_scheduled_tokens", ("num_scheduled_tokens",), "Scheduled tokens"),
    ("num_steps_with_preemption", ("num_steps_with_preemption",), "Steps that preempted"),
    (
        "swap_fallbacks_to_recompute",
        ("swap_fallbacks_to_recompute",),
        "Swap preemptions done by recompute for want of host blocks",
    ),
    (
        "fragmented_alloc_failures",
        ("fragmented_alloc_failures",),
        "Allocations refused for want of a free run although enough blocks were free",
    ),
    ("window_freed_blocks", ("window_freed_blocks",), "Blocks freed out of the KV window"),
    # Speculative decoding: vLLM v1's spec_decode_* counters, under the kvserve: prefix.
    ("spec_decode_num_drafts", ("spec_decode_num_drafts",), "Verifications of draft tokens"),
    ("spec_decode_num_draft_tokens", ("spec_decode_num_draft_tokens",), "Draft tokens"),
    (
        "spec_decode_num_accepted_tokens",
        ("spec_decode_num_accepted_tokens",),
        "Draft tokens accepted",
    ),
]
# The per-position counter (vLLM's spec_decode_num_accepted_tokens_per_pos, label
# ``position``): stats() key prefix -> position.
_PER_POS = "spec_decode_num_accepted_tokens_per_pos"

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip


def _lookup(stats: Mapping[str, Any], keys: tuple[str, ...]) -> float | None:
    for key in keys:
        value = stats.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


class _EngineStatsCollector(Collector):
    """Exposes the latest engine.stats() snapshot as gauges and counters."""

    def __init__(self) -> None:
        self.stats: Mapping[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        for name, keys, help_ in _GAUGES:
            value = _lookup(self.stats, keys)
            if value is not None:
                yield GaugeMetricFamily(PREFIX + name, help_, value=value)
        for name, keys, help_ in _COUNTERS:
            value = _lookup(self.stats, keys)
            if value is not None:
                # NOTE: prometheus_client appends the `_total` suffix to counters itself.
                yield CounterMetricFamily(PREFIX + name, help_, value=value)
        per_pos = sorted(
            (int(key.rsplit("_", 1)[1]), float(value))
            for key, value in self.stats.items()
            if key.startswith(_PER_POS + "_")
        )
        if per_pos:
            family = CounterMetricFamily(
                PREFIX + _PER_POS, "Draft tokens accepted, by draft position", labels=["position"]
            )
            for pos, value in per_pos:
                family.add_metric([str(pos)], value)
            yield family


class ServerMetrics:
    """The metrics of one app; also the async engine's OutputObserver (latency histograms)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine_stats = _EngineStatsCollector()
        self.registry.register(self._engine_stats)
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token")
        self.itl = self._histogram("inter_token_latency_seconds", "Time between output tokens")
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish")
        self.tpot = self._histogram(
            "request_time_per_output_token_seconds", "Mean time per output token after the first"
        )
        self.queue_time = self._histogram("request_queue_time_seconds", "Arrival to scheduled")
        # request id -> time its last token was routed (one entry per sample index)
        self._last_token_time: dict[str, dict[int, float]] = {}

    def _histogram(self, name: str, help_: str) -> Histogram:
        return Histogram(PREFIX + name, help_, buckets=_LATENCY_BUCKETS, registry=self.registry)

    def set_engine_stats(self, stats: Mapping[str, Any]) -> None:
        """Remember the snapshot the next scrape exposes."""
        self._engine_stats.stats = stats

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)

    # ---- OutputObserver -------------------------------------------------------------------

    def on_output(self, output: RequestOutput) -> None:
        """Record inter-token gaps; TTFT and queue time at the request's first token (a
        stream aborted later still counts, as vLLM records it); e2e and TPOT on the final
        output."""
        now = time.monotonic()
        last = self._last_token_time.setdefault(output.request_id, {})
        m = output.metrics
        if not last and m is not None and any(c.delta_token_ids for c in output.outputs):
            for hist, value in ((self.ttft, m.ttft), (self.queue_time, m.queue_time)):
                if value is not None:
                    hist.observe(value)
        for completion in output.outputs:
            if not completion.delta_token_ids:
                continue
            prev = last.get(completion.index)
            if prev is not None:
                gap = (now - prev) / len(completion.delta_token_ids)
                for _ in completion.delta_token_ids:
                    self.itl.observe(gap)
            last[completion.index] = now
        if output.finished and m is not None:
            for hist, value in ((self.e2e, m.e2e), (self.tpot, m.tpot)):
                if value is not None:
                    hist.observe(value)

    def on_request_done(self, request_id: str) -> None:
        """Forget a finished or aborted request."""
        self._last_token_time.pop(request_id, None)
