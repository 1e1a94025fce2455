"""The simulator loop: the real core/ Scheduler and KVCacheManager on a virtual clock.

Each step: add the requests that have arrived, ``sched = scheduler.schedule()``, time it with
the cost model, let a runner produce the sampled tokens (the fake runner by default; the real
``ModelRunner.execute`` plugs in the same way), ``scheduler.update_from_output``, advance the
clock by the step time, record latencies and KV figures.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvserve.config import SchedulerConfig
from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.core.sched.scheduler import Scheduler
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.sim.metrics import LatencyRecorder, latency_summary
from kvserve.sim.workloads import DEFAULT_VOCAB_SIZE, WorkloadRequest, resolve_prompt_token_ids

Runner = Callable[[SchedulerOutput], ModelRunnerOutput]
StepTimeFn = Callable[[SchedulerOutput], float]
# One step of a trace: what was scheduled, as (request_id, num_tokens), in order.
StepTrace = list[tuple[str, int]]


class VirtualClock:
    """The simulated time; pass it as the Scheduler's ``clock``."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class FakeRunner:
    """Stands in for the model: one deterministic token per ``sample=True`` request.

    A request with a scripted reply (``scripted[request_id]``) gets those tokens in order;
    others get a pseudo-random id from their request id and output position. It never
    samples an EOS on purpose: requests end by ``max_tokens`` (the trace's output_len), and
    the simulator submits them with ``ignore_eos=True`` and no eos id.
    """

    def __init__(
        self, vocab_size: int = DEFAULT_VOCAB_SIZE, scripted: dict[str, list[int]] | None = None
    ) -> None:
        self.vocab_size = vocab_size
        self.scripted = scripted or {}

    def token_for(self, request_id: str, index: int) -> int:
        """The token this runner samples at output position ``index`` of ``request_id``."""
        script = self.scripted.get(request_id)
        if script is not None and index < len(script):
            return script[index]
        h = zlib.crc32(request_id.encode()) + 7919 * index
        return 10 + h % (self.vocab_size - 10)

    def __call__(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        sampled = {
            r.request_id: self.token_for(r.request_id, len(r.output_token_ids))
            for r in sched.scheduled
            if r.sample
        }
        return ModelRunnerOutput(sampled_token_ids=sampled)


@dataclass
class SimResult:
    """Everything a run measured. Times are virtual seconds from the trace start."""

    latency: LatencyRecorder
    duration_s: float
    num_steps: int
    step_end_times: np.ndarray  # [num_steps]
    step_times: np.ndarray  # [num_steps] seconds each step took
    step_num_tokens: np.ndarray  # [num_steps]
    step_num_running: np.ndarray  # [num_steps] running requests after the step's schedule
    step_kv_usage: np.ndarray  # [num_steps]
    fragmentation_samples: np.ndarray  # fragmentation at sampled steps with live requests
    stats: dict[str, float | int]  # Scheduler.stats() at the end
    rejected: dict[str, str] = field(default_factory=dict)  # request_id -> reason
    trace: list[StepTrace] | None = None

    def summary(self) -> dict[str, float]:
        """Latency / throughput figures plus the KV and scheduler figures of the run."""
        s = latency_summary(self.latency, self.duration_s)
        frag = self.fragmentation_samples
        s.update(
            num_steps=float(self.num_steps),
            num_rejected=float(len(self.rejected)),
            peak_kv_usage=float(self.step_kv_usage.max()) if self.num_steps else 0.0,
            mean_kv_usage=float(self.step_kv_usage.mean()) if self.num_steps else 0.0,
            mean_fragmentation=float(frag.mean()) if len(frag) else 0.0,
            max_concurrent_requests=float(self.stats.get("max_concurrent_requests", 0)),
            prefix_hit_rate=float(self.stats.get("prefix_hit_rate", 0.0)),
            preemptions=float(self.stats.get("preemptions", 0)),
            recomputed_tokens_wasted=float(self.stats.get("recomputed_tokens_wasted", 0)),
            swap_out_blocks=float(self.stats.get("swap_out_blocks", 0)),
            swap_in_blocks=float(self.stats.get("swap_in_blocks", 0)),
        )
        return s


def record_step(
    rec: LatencyRecorder, sched: SchedulerOutput, done: list[Request], now: float
) -> None:
    """Record one simulated step at virtual time ``now``: a token for every scheduled
    request that sampled, and the finish (cached tokens, preemptions) of those done."""
    for r in sched.scheduled:
        if r.sample:
            rec.token(r.request_id, now)
    for r in done:
        if r.is_finished:
            rec.finish(r.request_id, now)
            t = rec.timings[r.request_id]
            t.num_cached_tokens = max(r.num_cached_tokens, 0)
            t.num_preemptions = r.num_preemptions


def to_request(w: WorkloadRequest, vocab_size: int, params: dict[int, SamplingParams]) -> Request:
    """The engine request for trace entry ``w`` (its SamplingParams shared per output length)."""
    sp = params.get(w.output_len)
    if sp is None:
        sp = params[w.output_len] = SamplingParams(
            max_tokens=w.output_len, temperature=0.0, ignore_eos=True
        )
    return Request(
        request_id=w.request_id,
        prompt_token_ids=resolve_prompt_token_ids(w, vocab_size),
        sampling_params=sp,
        eos_token_id=None,
        arrival_time=w.arrival_time,
    )


class Simulator:
    """Replays a trace through a Scheduler whose ``clock`` is ``clock``.

    ``step_time(sched)`` gives each step's duration (a CostModel, or a list of recorded step
    times wrapped in a callable). ``runner(sched)`` gives the sampled tokens (FakeRunner by
    default; the real ``ModelRunner.execute`` fits). With ``use_runner_time`` the clock
    advances by the runner's ``execute_time`` instead (real-engine replay).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        step_time: StepTimeFn | None,
        clock: VirtualClock,
        *,
        runner: Runner | None = None,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        use_runner_time: bool = False,
        record_trace: bool = False,
        kv_sample_every: int = 1,
        max_steps: int = 10_000_000,
    ) -> None:
        if step_time is None and not use_runner_time:
            raise ValueError("Simulator needs a step_time function or use_runner_time=True")
        if scheduler.clock is not clock:
            raise ValueError("the Scheduler must be built with the simulator's VirtualClock")
        if kv_sample_every < 1:
            raise ValueError(f"kv_sample_every must be >= 1, got {kv_sample_every}")
        self.scheduler = scheduler
        self.step_time = step_time
        self.clock = clock
        self.runner = runner
        self.vocab_size = vocab_size
        self.use_runner_time = use_runner_time
        self.record_trace = record_trace
        self.kv_sample_every = kv_sample_every
        self.max_steps = max_steps

    def run(self, workload: Sequence[WorkloadRequest]) -> SimResult:
        """Replay ``workload`` until every request finished; returns the measurements."""
        sched_ = self.scheduler
        clock = self.clock
        kv = sched_.kv
        pending = sorted(workload, key=lambda w: w.arrival_time)
        scripted = {w.request_id: w.output_token_ids for w in pending if w.output_token_ids}
        runner = self.runner or FakeRunner(self.vocab_size, scripted)
        params: dict[int, SamplingParams] = {}
        rec = LatencyRecorder()
        rejected: dict[str, str] = {}
        trace: list[StepTrace] | None = [] if self.record_trace else None
        ends: list[float] = []
        dts: list[float] = []
        ntoks: list[int] = []
        nrun: list[int] = []
        usage: list[float] = []
        frags: list[float] = []
        start = clock.now
        i = 0
        while True:
            while i < len(pending) and start + pending[i].arrival_time <= clock.now:
                # NOTE: compared as start + arrival (the value the clock is set to below): with
                # arrival <= now - start, rounding could keep it false when start != 0 (a hang).
                w = pending[i]
                i += 1
                req = to_request(w, self.vocab_size, params)
                req.arrival_time = start + w.arrival_time
                try:
                    sched_.add_request(req)
                except ValueError as e:
                    rejected[w.request_id] = str(e)
                    continue
                rec.arrive(w.request_id, req.arrival_time, w.prompt_len)
            if not sched_.has_unfinished_requests():
                if i >= len(pending):
                    break
                clock.now = max(clock.now, start + pending[i].arrival_time)
                continue
            if len(ends) >= self.max_steps:
                raise RuntimeError(f"simulation exceeded max_steps={self.max_steps}")
            out_sched = sched_.schedule()
            if out_sched.is_empty:
                sched_.update_from_output(out_sched, ModelRunnerOutput())
                if i < len(pending):
                    clock.now = max(clock.now, start + pending[i].arrival_time)
                    continue
                raise RuntimeError(
                    f"scheduler made no progress with {sched_.num_running} running, "
                    f"{sched_.num_waiting} waiting, {sched_.num_swapped} swapped requests"
                )
            num_running = sched_.num_running
            out = runner(out_sched)
            dt = out.execute_time if self.use_runner_time else self.step_time(out_sched)  # type: ignore[misc]
            clock.now += dt
            done = sched_.update_from_output(out_sched, out)
            now = clock.now
            record_step(rec, out_sched, done, now)
            if trace is not None:
                trace.append([(r.request_id, len(r.token_ids)) for r in out_sched.scheduled])
            ends.append(now - start)
            dts.append(dt)
            ntoks.append(out_sched.total_num_scheduled_tokens)
            nrun.append(num_running)
            usage.append(kv.usage)
            if len(ends) % self.kv_sample_every == 0 and sched_.num_running:
                frags.append(float(kv.snapshot()["fragmentation"]))
        return SimResult(
            latency=rec,
            duration_s=clock.now - start,
            num_steps=len(ends),
            step_end_times=np.asarray(ends),
            step_times=np.asarray(dts),
            step_num_tokens=np.asarray(ntoks),
            step_num_running=np.asarray(nrun),
            step_kv_usage=np.asarray(usage),
            fragmentation_samples=np.asarray(frags),
            stats=sched_.stats(),
            rejected=rejected,
            trace=trace,
        )


def build_scheduler(
    config: SchedulerConfig,
    num_kv_blocks: int,
    block_size: int = 16,
    *,
    enable_prefix_caching: bool = True,
    num_host_blocks: int = 0,
    clock: VirtualClock | None = None,
) -> tuple[Scheduler, VirtualClock]:
    """A real KVCacheManager + Scheduler pair on a virtual clock."""
    clock = clock or VirtualClock()
    kv = KVCacheManager(
        num_kv_blocks,
        block_size,
        enable_prefix_caching=enable_prefix_caching,
        num_host_blocks=num_host_blocks,
    )
    return Scheduler(config, kv, clock=clock), clock


def simulate(
    workload: Sequence[WorkloadRequest],
    config: SchedulerConfig,
    step_time: StepTimeFn,
    num_kv_blocks: int,
    block_size: int = 16,
    *,
    enable_prefix_caching: bool = True,
    num_host_blocks: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    record_trace: bool = False,
    kv_sample_every: int = 1,
) -> SimResult:
    """Build a fresh scheduler + KV cache manager and replay ``workload`` through them."""
    scheduler, clock = build_scheduler(
        config,
        num_kv_blocks,
        block_size,
        enable_prefix_caching=enable_prefix_caching,
        num_host_blocks=num_host_blocks,
    )
    sim = Simulator(
        scheduler,
        step_time,
        clock,
        vocab_size=vocab_size,
        record_trace=record_trace,
        kv_sample_every=kv_sample_every,
    )
    return sim.run(workload)
