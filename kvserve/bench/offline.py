"""Run a trace through an in-process :class:`LLMEngine` and measure it step by step.

Used by ``bench throughput``, ``bench capacity`` and ``bench prefix``. The capacity figures
(names from ``LLM.stats()``) are measured over this run only: cumulative counters are taken
as differences, peaks and means are sampled after every engine step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvserve.bench.stats import summarize
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.sim.workloads import WorkloadRequest

if TYPE_CHECKING:
    from kvserve.engine import LLMEngine

T = TypeVar("T")

# Counters of engine.stats() reported as (after - before) for the run.
_COUNTERS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prefix_cache_evictions",
    "preemptions",
    "recomputed_tokens_wasted",
    "num_scheduled_requests",
    "swap_out_blocks",
    "swap_in_blocks",
    "cow_copies",
    "alloc_time_s",
    "num_steps",
)


@dataclass
class StepSampler:
    """Peaks and step-means of the pool figures, sampled after each engine step."""

    num_steps: int = 0
    peak_running: int = 0
    peak_kv_usage: float = 0.0
    sum_kv_usage: float = 0.0
    sum_kv_utilization: float = 0.0
    num_busy_steps: int = 0  # steps with at least one live request (utilization is defined)

    def sample(self, engine: LLMEngine) -> None:
        """Record the state of ``engine`` right after a step."""
        self.num_steps += 1
        running = engine.scheduler.last_step.num_running
        usage = engine.kv_cache_manager.usage
        self.peak_running = max(self.peak_running, running)
        self.peak_kv_usage = max(self.peak_kv_usage, usage)
        self.sum_kv_usage += usage
        if usage > 0:
            snap = engine.kv_cache_manager.snapshot()
            self.sum_kv_utilization += float(snap["kv_utilization"])
            self.num_busy_steps += 1

    def as_dict(self) -> dict[str, float]:
        steps = max(self.num_steps, 1)
        return {
            "max_concurrent_requests": self.peak_running,
            "kv_usage_peak": self.peak_kv_usage,
            "kv_usage_mean": self.sum_kv_usage / steps,
            "kv_utilization": self.sum_kv_utilization / max(self.num_busy_steps, 1),
        }


@dataclass
class OfflineRun:
    """Finished outputs of a run plus its figures."""

    outputs: list[RequestOutput] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)


def sampling_for(req: WorkloadRequest, *, ignore_eos: bool, temperature: float) -> SamplingParams:
    """Greedy (or tempered) sampling of exactly ``output_len`` tokens when EOS is ignored."""
    return SamplingParams(
        temperature=temperature,
        max_tokens=req.output_len,
        ignore_eos=ignore_eos,
        seed=0 if temperature > 0 else None,
    )


def warm_up(engine: LLMEngine, num_tokens: int = 4) -> None:
    """One short request so one-off costs (first kernels, allocator) are not timed.

    The prefix cache is reset afterwards so the warm-up cannot create hits.
    """
    engine.add_request([11, 12, 13, 14], SamplingParams(max_tokens=num_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_cache_manager.reset_prefix_cache()


def run_offline(
    engine: LLMEngine,
    requests: list[WorkloadRequest],
    *,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    replay_arrivals: bool = False,
    max_concurrency: int | None = None,
) -> OfflineRun:
    """Run ``requests`` to completion; returns outputs (in trace order) and figures.

    By default every request is queued at once (offline throughput). ``replay_arrivals``
    queues each request at its ``arrival_time`` (wall clock from the start).
    ``max_concurrency`` keeps at most that many requests in the engine (a static-client
    style bound, like ``bench serve --max-concurrency``).
    """
    if engine.has_unfinished_requests():
        raise ValueError("the engine still has unfinished requests")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    before = engine.stats()
    sampler = StepSampler()
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)
    finals: dict[str, RequestOutput] = {}
    ids: list[str] = [f"bench-{i}-{r.request_id}" for i, r in enumerate(requests)]
    next_i = 0
    in_flight = 0
    t0 = time.perf_counter()
    while len(finals) < len(requests):
        now = time.perf_counter() - t0
        while next_i < len(order) and (max_concurrency is None or in_flight < max_concurrency):
            req = requests[order[next_i]]
            if replay_arrivals and req.arrival_time > now:
                break
            if req.prompt_token_ids is None:
                raise ValueError(f"request {req.request_id} has no prompt_token_ids")
            engine.add_request(
                req.prompt_token_ids,
                sampling_for(req, ignore_eos=ignore_eos, temperature=temperature),
                request_id=ids[order[next_i]],
            )
            next_i += 1
            in_flight += 1
        if not engine.has_unfinished_requests():
            if next_i >= len(order):
                missing = sorted(set(ids) - set(finals))
                raise RuntimeError(f"engine went idle without finishing {missing[:5]}")
            # Idle until the next arrival (replay only).
            time.sleep(max(0.0, requests[order[next_i]].arrival_time - now))
            continue
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
                in_flight -= 1
        sampler.sample(engine)
    elapsed = time.perf_counter() - t0
    after = engine.stats()
    outputs = [finals[i] for i in ids]
    return OfflineRun(outputs, _figures(outputs, elapsed, before, after, sampler))


def _figures(
    outputs: list[RequestOutput],
    elapsed: float,
    before: dict[str, Any],
    after: dict[str, Any],
    sampler: StepSampler,
) -> dict[str, Any]:
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in _COUNTERS}
    queries = delta["prefix_cache_queries"]
    scheduled = delta["num_scheduled_requests"]
    figures: dict[str, Any] = {
        "num_requests": len(outputs),
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "elapsed_s": elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": num_output / elapsed,
        "total_tokens_per_s": (num_prompt + num_output) / elapsed,
        **sampler.as_dict(),
        "fragmentation": 1.0 - sampler.as_dict()["kv_utilization"]
        if sampler.num_busy_steps
        else 0.0,
        "prefix_hit_rate": delta["prefix_cache_hits"] / queries if queries else 0.0,
        "num_cached_prompt_tokens": sum(o.num_cached_tokens for o in outputs),
        "preemptions": delta["preemptions"],
        "preemptions_per_1k_scheduled": 1000.0 * delta["preemptions"] / scheduled
        if scheduled
        else 0.0,
        "recomputed_tokens_wasted": delta["recomputed_tokens_wasted"],
        "num_steps": delta["num_steps"],
        "alloc_time_s": delta["alloc_time_s"],
        "num_kv_blocks": after.get("num_kv_blocks"),
        "block_size": after.get("block_size"),
        "kv_bytes_per_token": after.get("kv_bytes_per_token"),
    }
    metrics = [o.metrics for o in outputs if o.metrics is not None]
    for name in ("ttft", "tpot", "e2e", "queue_time"):
        values = [getattr(m, name) for m in metrics if getattr(m, name) is not None]
        figures[name] = summarize(values)
    return figures


def call_in_worker_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` on a fresh thread and return its result (its exception is re-raised).

    NOTE: measured 2026-11-29 on the 2-core box under load: engine steps ran ~20x faster on
    a non-main thread (8 tokens: 1.1 s vs 23 s), the way the server runs them. Exposed as
    ``bench throughput --step-thread`` so both numbers can be reported until it is understood.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the caller
            box["error"] = e

    worker = threading.Thread(target=target, name="kvserve-bench-step")
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
