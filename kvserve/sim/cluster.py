"""Data-parallel replicas in the simulator: the real router policy over real schedulers.

Each replica is a real Scheduler + KVCacheManager on its own virtual clock with the roofline
cost model (``kvserve/sim/simulator.py`` runs one). The cluster loop is a discrete-event
simulation: it steps the busy replica whose clock is furthest behind until every busy clock
has passed the next arrival, then routes that arrival with the real
``kvserve.router.policy`` (the same object ``kvserve router`` uses), given each replica's
load (running + waiting) at that instant, as the router reads it from /metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.core.outputs import ModelRunnerOutput
from kvserve.core.sched.scheduler import Scheduler
from kvserve.router.policy import RoutingPolicy
from kvserve.sampling_params import SamplingParams
from kvserve.sim.metrics import LatencyRecorder, latency_summary, percentile
from kvserve.sim.simulator import (
    FakeRunner,
    StepTimeFn,
    VirtualClock,
    build_scheduler,
    record_step,
    to_request,
)
from kvserve.sim.workloads import DEFAULT_VOCAB_SIZE, WorkloadRequest, resolve_prompt_token_ids


@dataclass
class _Replica:
    name: str
    scheduler: Scheduler
    clock: VirtualClock
    num_steps: int = 0


@dataclass
class ClusterResult:
    """What one cluster run measured."""

    latency: LatencyRecorder
    duration_s: float
    routed: dict[str, int]  # replica -> requests routed to it
    num_steps: dict[str, int]
    rejected: dict[str, str] = field(default_factory=dict)

    def summary(self, slo_ttft_s: float, slo_tpot_s: float) -> dict[str, float]:
        """Latency summary + prefix hit rate + goodput (finished requests within both SLOs)."""
        s = latency_summary(self.latency, self.duration_s)
        done = [t for t in self.latency.timings.values() if t.finish_time is not None]
        prompt = sum(t.num_prompt_tokens for t in done)
        cached = sum(t.num_cached_tokens for t in done)
        s["prefix_hit_rate"] = cached / prompt if prompt else 0.0
        good = [
            t
            for t in done
            if t.ttft is not None
            and t.ttft <= slo_ttft_s
            and (t.tpot is None or t.tpot <= slo_tpot_s)
        ]
        dur = max(self.duration_s, 1e-12)
        s["goodput_requests_per_s"] = len(good) / dur
        s["slo_attainment"] = len(good) / len(done) if done else 0.0
        ttfts = [t.ttft for t in done if t.ttft is not None]
        s["ttft_p90_s"] = percentile(ttfts, 90)
        counts = list(self.routed.values())
        s["routed_max_over_mean"] = max(counts) / (sum(counts) / len(counts)) if counts else 0.0
        return s


def simulate_cluster(
    workload: Sequence[WorkloadRequest],
    policy: RoutingPolicy,
    *,
    num_replicas: int,
    config: SchedulerConfig,
    step_time: StepTimeFn,
    num_kv_blocks: int,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_steps: int = 50_000_000,
) -> ClusterResult:
    """Replay ``workload`` over ``num_replicas`` fresh replicas routed by ``policy``."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    replicas = []
    for i in range(num_replicas):
        sched, clock = build_scheduler(
            config, num_kv_blocks, block_size, enable_prefix_caching=enable_prefix_caching
        )
        replicas.append(_Replica(f"replica-{i}", sched, clock))
    by_name = {r.name: r for r in replicas}
    pending = sorted(workload, key=lambda w: w.arrival_time)
    scripted = {w.request_id: w.output_token_ids for w in pending if w.output_token_ids}
    runner = FakeRunner(vocab_size, scripted)
    params: dict[int, SamplingParams] = {}
    rec = LatencyRecorder()
    routed = {r.name: 0 for r in replicas}
    rejected: dict[str, str] = {}
    total_steps = 0
    i = 0
    while True:
        next_arrival = pending[i].arrival_time if i < len(pending) else float("inf")
        busy = [r for r in replicas if r.scheduler.has_unfinished_requests()]
        lagging = min(busy, key=lambda r: r.clock.now, default=None)
        if lagging is not None and lagging.clock.now < next_arrival:
            _step(lagging, runner, step_time, rec)
            total_steps += 1
            if total_steps > max_steps:
                raise RuntimeError(f"cluster simulation exceeded max_steps={max_steps}")
            continue
        if i >= len(pending):
            break
        w = pending[i]
        i += 1
        key = resolve_prompt_token_ids(w, vocab_size)
        loads = {r.name: r.scheduler.num_running + r.scheduler.num_waiting for r in replicas}
        name = policy.choose(key, loads)
        policy.on_routed(name, key)
        target = by_name[name]
        target.clock.now = max(target.clock.now, w.arrival_time)
        req = to_request(w, vocab_size, params)
        req.arrival_time = w.arrival_time
        try:
            target.scheduler.add_request(req)
        except ValueError as e:
            rejected[w.request_id] = str(e)
            continue
        routed[name] += 1
        rec.arrive(w.request_id, w.arrival_time, w.prompt_len)
    end = max((r.clock.now for r in replicas), default=0.0)
    start = pending[0].arrival_time if pending else 0.0
    return ClusterResult(
        latency=rec,
        duration_s=end - start,
        routed=routed,
        num_steps={r.name: r.num_steps for r in replicas},
        rejected=rejected,
    )


def _step(
    replica: _Replica, runner: FakeRunner, step_time: StepTimeFn, rec: LatencyRecorder
) -> None:
    sched = replica.scheduler
    out_sched = sched.schedule()
    if out_sched.is_empty:
        sched.update_from_output(out_sched, ModelRunnerOutput())
        raise RuntimeError(
            f"{replica.name}: scheduler made no progress with {sched.num_running} running, "
            f"{sched.num_waiting} waiting"
        )
    out = runner(out_sched)
    replica.clock.now += step_time(out_sched)
    replica.num_steps += 1
    done = sched.update_from_output(out_sched, out)
    now = replica.clock.now
    record_step(rec, out_sched, done, now)
