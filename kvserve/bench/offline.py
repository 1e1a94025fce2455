"""Run a trace through an in-process :class:`LLMEngine` and measure it step by step.

Used by ``bench throughput``, ``bench capacity`` and ``bench prefix``. The capacity figures
(names from ``LLM.stats()``) are measured over this run only: cumulative counters are taken
as differences, peaks and means are sampled after every engine step. Each run also keeps a
per-step timeline (kv_usage, kv_utilization, running and waiting requests; at most
``MAX_TIMELINE_POINTS`` steps in the record) and per-request latencies for CDF plots.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvserve.bench.report import cdf_points, downsample_columns
from kvserve.bench.stats import summarize
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.sim.workloads import WorkloadRequest

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

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
    sum_running: int = 0
    peak_kv_usage: float = 0.0
    sum_kv_usage: float = 0.0
    sum_kv_utilization: float = 0.0
    num_busy_steps: int = 0  # steps with at least one live request (utilization is defined)
    # Per-step timeline, one entry per column per step (t_s: seconds since the run began).
    timeline: dict[str, list[float]] = field(
        default_factory=lambda: {
            k: [] for k in ("t_s", "kv_usage", "kv_utilization", "num_running", "num_waiting")
        }
    )

    def sample(self, engine: LLMEngine, t_s: float = 0.0) -> None:
        """Record the state of ``engine`` right after a step, ``t_s`` into the run."""
        self.num_steps += 1
        last = engine.scheduler.last_step
        running = last.num_running
        usage = engine.kv_cache_manager.usage
        self.peak_running = max(self.peak_running, running)
        self.sum_running += running
        self.peak_kv_usage = max(self.peak_kv_usage, usage)
        self.sum_kv_usage += usage
        util = 0.0
        if usage > 0:
            snap = engine.kv_cache_manager.snapshot()
            util = float(snap["kv_utilization"])
            self.sum_kv_utilization += util
            self.num_busy_steps += 1
        tl = self.timeline
        tl["t_s"].append(round(t_s, 4))
        tl["kv_usage"].append(round(usage, 4))
        tl["kv_utilization"].append(round(util, 4))
        tl["num_running"].append(running)
        tl["num_waiting"].append(last.num_waiting)

    def as_dict(self) -> dict[str, float]:
        steps = max(self.num_steps, 1)
        return {
            "max_concurrent_requests": self.peak_running,
            "mean_running_requests": self.sum_running / steps,
            "kv_usage_peak": self.peak_kv_usage,
            "kv_usage_mean": self.sum_kv_usage / steps,
            "kv_utilization": self.sum_kv_utilization / max(self.num_busy_steps, 1),
        }


@dataclass
class OfflineRun:
    """Finished outputs of a run plus its figures."""

    outputs: list[RequestOutput] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    # Columns t_s, kv_usage, kv_utilization, num_running, num_waiting (<= 500 steps).
    timeline: dict[str, list[float]] = field(default_factory=dict)
    # Sorted per-request ttft / tpot / e2e / queue_time in seconds (<= 1000 points each).
    latency_samples: dict[str, list[float]] = field(default_factory=dict)


def sampling_for(
    req: WorkloadRequest, *, ignore_eos: bool, temperature: float, max_tokens: int | None = None
) -> SamplingParams:
    """Greedy (or tempered) sampling of exactly ``output_len`` tokens when EOS is ignored.

    ``max_tokens`` (a client-side cap) replaces ``output_len`` as the request's max_tokens;
    ``run_offline`` then ends the request at ``output_len`` itself (see there).
    """
    return SamplingParams(
        temperature=temperature,
        max_tokens=req.output_len if max_tokens is None else max_tokens,
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
    max_tokens: int | None = None,
) -> OfflineRun:
    """Run ``requests`` to completion; returns outputs (in trace order) and figures.

    By default every request is queued at once (offline throughput). ``replay_arrivals``
    queues each request at its ``arrival_time`` (wall clock from the start).
    ``max_concurrency`` keeps at most that many requests in the engine (a static-client
    style bound, like ``bench serve --max-concurrency``).

    ``max_tokens``: every request asks for this many tokens (what a client that does not
    know the reply's length sends) and still ends after its trace ``output_len``: the run
    aborts it right after the step that produced that token, as if it had sampled EOS, and
    reports it finished with reason "stop". Only what the engine knows in advance changes
    (e.g. the contiguous allocator reserves prompt + max_tokens); the tokens do not. Requests
    with ``output_len > max_tokens`` end at max_tokens ("length").
    """
    if engine.has_unfinished_requests():
        raise ValueError("the engine still has unfinished requests")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    before = engine.stats()
    sampler = StepSampler()
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)
    finals: dict[str, RequestOutput] = {}
    ids: list[str] = [f"bench-{i}-{r.request_id}" for i, r in enumerate(requests)]
    output_lens = {rid: r.output_len for rid, r in zip(ids, requests, strict=True)}
    next_i = 0
    in_flight = 0
    gaps = TokenGaps()
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
                sampling_for(
                    req, ignore_eos=ignore_eos, temperature=temperature, max_tokens=max_tokens
                ),
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
        outs = engine.step()
        gaps.observe(outs, time.perf_counter())
        for out in outs:
            if not out.finished and max_tokens is not None:
                target = output_lens[out.request_id]
                if all(len(c.token_ids) >= target for c in out.outputs):
                    _stop_as_eos(engine, out)
            if out.finished:
                finals[out.request_id] = out
                in_flight -= 1
        sampler.sample(engine, time.perf_counter() - t0)
    elapsed = time.perf_counter() - t0
    after = engine.stats()
    outputs = [finals[i] for i in ids]
    return OfflineRun(
        outputs,
        _figures(outputs, elapsed, before, after, sampler),
        timeline=downsample_columns(sampler.timeline),
        latency_samples=_latency_samples(outputs, gaps.gaps),
    )


def _stop_as_eos(engine: LLMEngine, out: RequestOutput) -> None:
    """End a request that reached its trace length as if it had sampled EOS (``max_tokens``).

    Aborting frees its blocks at once, as a stop would; the output is marked finished with
    reason "stop" and its e2e is the abort time, taken from the engine's own clock.
    """
    request = engine.scheduler.get_request(out.request_id)
    engine.abort_request(out.request_id)
    out.finished = True
    for c in out.outputs:
        c.finish_reason = "stop"
    if request is not None and request.finished_time is not None and out.metrics is not None:
        out.metrics.e2e = request.finished_time - out.metrics.arrival_time


class TokenGaps:
    """Inter-token latencies (ITL) of every request, pooled, in seconds: the time between two
    steps that gave a request new tokens (all its samples' together), as ``bench serve``
    times the gaps between streamed chunks."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self._tokens: dict[str, int] = {}
        self._last: dict[str, float] = {}

    def observe(self, outputs: list[RequestOutput], now: float) -> None:
        """Record the outputs of one step, returned at ``now``."""
        for out in outputs:
            rid = out.request_id
            num = sum(len(c.token_ids) for c in out.outputs)
            if num <= self._tokens.get(rid, 0):
                continue
            if rid in self._last:
                self.gaps.append(now - self._last[rid])
            self._tokens[rid], self._last[rid] = num, now
            if out.finished:
                del self._tokens[rid], self._last[rid]


def _latency_samples(outputs: list[RequestOutput], itls: list[float]) -> dict[str, list[float]]:
    """Per-request latencies by name (``itl``: every gap, pooled), sorted and thinned for
    CDF plots."""
    metrics = [o.metrics for o in outputs if o.metrics is not None]
    samples = {
        name: cdf_points([v for m in metrics if (v := getattr(m, name)) is not None])
        for name in ("ttft", "tpot", "e2e", "queue_time")
    }
    samples["itl"] = cdf_points(itls)
    return samples


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


def run_trace(
    engine: LLMEngine,
    requests: list[WorkloadRequest],
    *,
    warmup: bool,
    step_thread: bool = False,
    **run_kwargs: Any,
) -> OfflineRun:
    """``warm_up`` (if ``warmup``) then ``run_offline(engine, requests, **run_kwargs)``.

    With ``step_thread`` both run on a worker thread (``call_in_worker_thread``), as the
    server steps its engine; the benchmarks' ``--warmup`` / ``--step-thread`` flags.
    """

    def run() -> OfflineRun:
        if warmup:
            warm_up(engine)
        return run_offline(engine, requests, **run_kwargs)

    return call_in_worker_thread(run) if step_thread else run()


def call_in_worker_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` on a fresh thread and return its result (its exception is re-raised).

    NOTE: the thread that runs torch's parallel work matters (``bench throughput
    --step-thread``). An engine built on the main thread and stepped on another ran at 19.5
    tok/s vs 33.4 on the main thread (idle box, B=1): libgomp then has two helper pools and
    cuts its spin-wait to 100 iterations (``async_engine.build_on_engine_thread``). Under
    heavy load from other processes the short spin helped instead (8 tokens: 1.1 s vs 23 s,
    measured earlier). ``--step-thread`` now builds the engine on a worker thread as well,
    as the server does.
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
