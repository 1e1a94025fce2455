"""Randomized liveness: hundreds of small workloads on a tiny pool that forces preemption.

Every request finishes, no block leaks, the KV manager's integrity holds every step, and
each request's tokens are exactly those it yields alone and unpressured: the FakeRunner's
tokens are a hash of the prefix as read back through the block table, so preemption,
recompute, swap, prefix hits and copy-on-write must all preserve positions exactly. The
pressured run is also compared against the same workload on a huge pool.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.sched.scheduler import Scheduler
from kvserve.request import Request, RequestStatus
from tests.core.fake_runner import (
    Driver,
    FakeClock,
    FakeRunner,
    assert_pool_idle,
    expected_output,
    make_request,
)
from tests.examples import examples

NUM_WORKLOADS = examples(100)
VOCAB = 50
MAX_MODEL_LEN = 64


@dataclass
class Spec:
    """One request of a workload, and when it arrives / is aborted (in steps)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int | None
    priority: int
    n: int
    seed: int | None
    eos_token_id: int | None
    min_tokens: int
    stop_token_ids: list[int] | None
    arrive_step: int
    abort_step: int | None
    abort_id: str  # the parent or one of its samples

    def build(self) -> Request:
        return make_request(
            self.request_id,
            self.prompt_token_ids,
            max_tokens=self.max_tokens,
            priority=self.priority,
            arrival_time=self.arrive_step + int(self.request_id[1:]) * 1e-3,
            n=self.n,
            seed=self.seed,
            eos_token_id=self.eos_token_id,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids,
        )


@dataclass
class Workload:
    specs: list[Spec]
    block_size: int
    num_blocks: int
    num_host_blocks: int
    config: dict


def random_workload(rng: random.Random, mode: str) -> Workload:
    """12-20 short requests (n up to 3) on a pool that holds only the largest one.

    Tiny blocks and many concurrent sequences make the pool overflow on a third of the
    steps. Some workloads turn on headroom and hysteresis, or turn off chunked prefill.
    """
    block_size = rng.choice([1, 1, 1, 2])
    chunked = rng.random() < 0.9
    budget = rng.choice([8, 16, 32])
    headroom, watermark = rng.choice([(0.0, 0.0)] * 8 + [(0.1, 0.1), (0.1, 0.3)])
    config = dict(
        max_num_seqs=rng.randint(6, 8),
        max_num_batched_tokens=budget,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
        admission_headroom=headroom,
        resume_watermark=watermark,
    )
    stems = [[rng.randrange(VOCAB) for _ in range(4)] for _ in range(2)]
    specs = []
    for i in range(rng.randint(12, 20)):
        num_prompt = rng.randint(1, 3)
        stem = rng.choice(stems)[: rng.randint(0, num_prompt)]  # shared prefixes
        prompt = stem + [rng.randrange(VOCAB) for _ in range(num_prompt - len(stem))]
        max_tokens = None if rng.random() < 0.03 else rng.randint(2, 6)
        n = rng.choice([1, 2, 3, 3])
        specs.append(
            Spec(
                request_id=f"r{i}",
                prompt_token_ids=prompt,
                max_tokens=max_tokens,
                priority=rng.choice([0, 0, 1, 2]),
                n=n,
                seed=rng.randrange(100) if n > 1 or rng.random() < 0.3 else None,
                eos_token_id=rng.randrange(VOCAB) if rng.random() < 0.3 else None,
                min_tokens=min(rng.choice([0, 0, 2]), max_tokens or 2),
                stop_token_ids=[rng.randrange(VOCAB)] if rng.random() < 0.1 else None,
                arrive_step=rng.randint(0, 10) if i else 0,
                abort_step=rng.randint(0, 30) if rng.random() < 0.15 else None,
                abort_id=f"r{i}" if n == 1 or rng.random() < 0.5 else f"r{i}#{n - 1}",
            )
        )
    largest = max(len(s.prompt_token_ids) + (s.max_tokens or 6) for s in specs)
    num_blocks = -(-largest // block_size)
    num_host_blocks = rng.choice([0, num_blocks // 2, 2 * num_blocks]) if mode == "swap" else 0
    return Workload(specs, block_size, num_blocks, num_host_blocks, config)


def _state(scheduler: Scheduler, request: Request) -> str:
    if request.status == RequestStatus.WAITING and request not in scheduler.waiting:
        return "PENDING_CHILD"
    return request.status.name


def run_workload(
    w: Workload,
    *,
    num_blocks: int,
    honour_aborts: bool,
    abort_states: Counter[str] | None = None,
    check_integrity: bool = True,
) -> tuple[Scheduler, dict[str, Request]]:
    """Run ``w`` to completion on a pool of ``num_blocks``; returns every Request by id.

    ``abort_states`` counts the state each abort found its request in.
    """
    kv = KVCacheManager(num_blocks, w.block_size, num_host_blocks=w.num_host_blocks)
    clock = FakeClock()
    scheduler = Scheduler(SchedulerConfig(**w.config), kv, clock=clock)
    runner = FakeRunner(num_blocks, w.block_size, w.num_host_blocks, VOCAB)
    driver = Driver(scheduler, runner, clock, check_integrity=check_integrity)
    requests: dict[str, Request] = {}
    step = 0
    pending = sorted(w.specs, key=lambda s: s.arrive_step)
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0].arrive_step <= step:
            request = pending.pop(0).build()
            scheduler.add_request(request)
            requests.update({r.request_id: r for r in (request, *request.pending_children)})
        for spec in w.specs:
            if honour_aborts and spec.abort_step == step:
                target = scheduler.get_request(spec.abort_id)
                if target is not None and abort_states is not None:
                    abort_states[_state(scheduler, target)] += 1
                scheduler.finish_requests(spec.abort_id, RequestStatus.FINISHED_ABORTED)
        _check_queues(scheduler)
        driver.step()
        step += 1
        assert step < 5000, "workload did not finish: scheduler is not live"
    assert_pool_idle(kv)
    return scheduler, requests


def _check_queues(s: Scheduler) -> None:
    """Every unfinished request sits in exactly one place, with the matching status."""
    pending = [c for r in (*s.waiting, *s.running, *s.swapped) for c in r.pending_children]
    assert len(s.waiting) + len(s.running) + len(s.swapped) + len(pending) == len(s.requests)
    assert all(r.status == RequestStatus.RUNNING for r in s.running)
    assert all(r.status == RequestStatus.SWAPPED for r in s.swapped)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in s.waiting)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_random_workloads_are_live_and_exact(mode: str) -> None:
    rng = random.Random(f"liveness-{mode}")
    num_steps = num_preempted_steps = 0
    abort_states: Counter[str] = Counter()
    totals: Counter[str] = Counter()
    for _ in range(NUM_WORKLOADS):
        w = random_workload(rng, mode)
        small, got = run_workload(
            w, num_blocks=w.num_blocks, honour_aborts=True, abort_states=abort_states
        )
        _, ref = run_workload(w, num_blocks=1024, honour_aborts=False, check_integrity=False)
        num_steps += small.totals.num_steps
        num_preempted_steps += small.totals.num_steps_with_preemption
        totals.update(
            preemptions_swap=small.totals.preemptions_swap,
            preemptions_recompute=small.totals.preemptions_recompute,
        )
        for rid, r in got.items():
            assert r.is_finished, rid
            oracle = expected_output(r, small, VOCAB)
            reference = ref[rid].output_token_ids
            if r.status == RequestStatus.FINISHED_ABORTED:
                assert oracle[: r.num_output_tokens] == r.output_token_ids, rid
            else:
                assert r.output_token_ids == oracle, rid
            # The big pool lifts only the pool-size stop, so it runs at least as far.
            assert reference[: r.num_output_tokens] == r.output_token_ids, rid
    fraction = num_preempted_steps / num_steps
    assert fraction >= 0.3, f"only {fraction:.0%} of steps preempted: pool not tight enough"
    for state in ("WAITING", "RUNNING", "PENDING_CHILD"):
        assert abort_states[state] > 0, f"no abort hit a {state} request: {abort_states}"
    if mode == "swap":
        assert totals["preemptions_swap"] > 0 and totals["preemptions_recompute"] > 0
        assert abort_states["SWAPPED"] > 0, abort_states
    else:
        assert abort_states["PREEMPTED"] > 0, abort_states
