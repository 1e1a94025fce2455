"""Async scheduling in the scheduler (``core/sched/ahead.py``), on the FakeRunner.

``AsyncDriver`` steps as ``LLMEngine`` does under ``async_scheduling``: step N+1 is
scheduled before step N has run (one placeholder token per sampling request), step N's
tokens are applied, step N+1's placeholders resolved, and only then does it run. The
FakeRunner checks every input token and every slot against the true prefix, and each
request's tokens must be those it yields alone and unpressured (the oracle): preemption
(recompute and swap), prefix hits, chunked prefill, n > 1 forks, stops and aborts while a
step is in flight must all keep positions and tokens exact, and the pool must end idle.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.outputs import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from kvserve.core.sched.ahead import can_schedule_ahead, resolve_ahead
from kvserve.core.sched.scheduler import Scheduler
from kvserve.request import Request, RequestStatus
from tests.core.fake_runner import (
    FakeClock,
    FakeRunner,
    assert_pool_idle,
    expected_output,
    make_request,
)
from tests.core.sched_helpers import VOCAB, prompt
from tests.core.test_scheduler_liveness import Workload, random_workload
from tests.examples import examples

NUM_WORKLOADS = examples(60)


class AsyncDriver:
    """Schedule ahead -> run step N -> apply it -> resolve step N+1 (module docstring)."""

    def __init__(self, scheduler: Scheduler, runner: FakeRunner, clock: FakeClock) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.clock = clock
        self.inflight: SchedulerOutput | None = None
        self.num_ahead = 0  # steps scheduled before the step before them had run
        self.num_placeholders = 0  # placeholder tokens those steps carried
        self.num_dropped = 0  # requests whose work ahead was dropped (finished meanwhile)

    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.inflight is not None

    def step(self) -> list[Request]:
        s = self.scheduler
        if self.inflight is None:
            self.inflight = s.schedule()
        current = self.inflight
        nxt = s.schedule() if can_schedule_ahead(s.requests, current) else None
        s.kv.check_integrity()
        if nxt is not None:
            self.num_ahead += 1
            self.num_placeholders += sum(
                sr.token_ids.count(PLACEHOLDER_TOKEN_ID) for sr in nxt.scheduled
            )
            assert all(  # a placeholder is only ever a decode's one input token
                sr.token_ids == [PLACEHOLDER_TOKEN_ID]
                for sr in nxt.scheduled
                if PLACEHOLDER_TOKEN_ID in sr.token_ids
            )
        touched = s.update_from_output(current, self.runner.execute(current))
        s.kv.check_integrity()
        self.inflight = None
        if nxt is not None:
            self.num_dropped += len(resolve_ahead(s.requests, nxt))
            moves = nxt.blocks_to_swap_out or nxt.blocks_to_swap_in or nxt.blocks_to_copy
            self.inflight = nxt if nxt.scheduled or moves else None
        self.clock.now += 1.0
        return touched


def _driver(num_blocks: int, block_size: int, num_host_blocks: int = 0, **config: object):
    settings: dict = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256)
    settings.update(admission_headroom=0.0, resume_watermark=0.0, async_scheduling=True)
    settings.update(config)
    kv = KVCacheManager(num_blocks, block_size, num_host_blocks=num_host_blocks)
    clock = FakeClock()
    runner = FakeRunner(num_blocks, block_size, num_host_blocks, VOCAB)
    return AsyncDriver(Scheduler(SchedulerConfig(**settings), kv, clock=clock), runner, clock)


def _run(d: AsyncDriver, max_steps: int = 5000) -> int:
    for num_steps in range(max_steps):
        if not d.busy():
            return num_steps
        d.step()
    raise AssertionError("requests still unfinished")


def test_decodes_are_scheduled_ahead_with_one_placeholder_each() -> None:
    d = _driver(num_blocks=64, block_size=4)
    reqs = [make_request(f"r{i}", prompt(5, base=i), max_tokens=6 + i) for i in range(4)]
    for r in reqs:
        d.scheduler.add_request(r)
    _run(d)
    for r in reqs:
        assert r.output_token_ids == expected_output(r, d.scheduler, VOCAB), r.request_id
        assert r.num_output_placeholders == 0
    assert d.num_ahead >= 9 and d.num_placeholders >= 9 * 2
    # NOTE: a request whose in-flight token surely ends it (max_tokens) is not scheduled
    # ahead, so nothing here was dropped.
    assert d.num_dropped == 0
    assert_pool_idle(d.scheduler.kv)


def test_eos_mid_flight_drops_the_work_ahead() -> None:
    d = _driver(num_blocks=64, block_size=4)
    probe = make_request("probe", prompt(6, base=3), max_tokens=12)
    d.scheduler.add_request(probe)
    _run(d)
    eos = probe.output_token_ids[4]  # its 5th token: EOS for the real run
    r = make_request("r", prompt(6, base=3), max_tokens=12, eos_token_id=eos)
    other = make_request("o", prompt(6, base=5), max_tokens=12)
    d.scheduler.add_request(r)
    d.scheduler.add_request(other)
    _run(d)
    assert r.output_token_ids == probe.output_token_ids[:5]
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert other.output_token_ids == expected_output(other, d.scheduler, VOCAB)
    assert d.num_dropped >= 1
    assert_pool_idle(d.scheduler.kv)


def test_abort_while_a_step_is_in_flight() -> None:
    d = _driver(num_blocks=64, block_size=4)
    a = make_request("a", prompt(7, base=1), max_tokens=20)
    b = make_request("b", prompt(7, base=2), max_tokens=20)
    d.scheduler.add_request(a)
    d.scheduler.add_request(b)
    for _ in range(4):
        d.step()
    assert d.inflight is not None and a.num_output_placeholders == 1
    d.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    _run(d)
    oracle = expected_output(a, d.scheduler, VOCAB)
    assert a.output_token_ids == oracle[: a.num_output_tokens]
    assert b.output_token_ids == expected_output(b, d.scheduler, VOCAB)
    assert_pool_idle(d.scheduler.kv)


def test_n_samples_fork_on_a_step_that_is_not_scheduled_ahead_of() -> None:
    d = _driver(num_blocks=64, block_size=4)
    r = make_request("p", prompt(9, base=4), max_tokens=5, n=3, seed=11)
    d.scheduler.add_request(r)
    children = list(r.pending_children)
    _run(d)
    for req in (r, *children):
        assert req.output_token_ids == expected_output(req, d.scheduler, VOCAB), req.request_id
    assert_pool_idle(d.scheduler.kv)


def run_async_workload(w: Workload) -> tuple[Scheduler, dict[str, Request], Counter[str]]:
    """``test_scheduler_liveness.run_workload``, stepped ahead (aborts land mid-flight)."""
    kv = KVCacheManager(w.num_blocks, w.block_size, num_host_blocks=w.num_host_blocks)
    clock = FakeClock()
    scheduler = Scheduler(SchedulerConfig(**w.config, async_scheduling=True), kv, clock=clock)
    d = AsyncDriver(
        scheduler, FakeRunner(w.num_blocks, w.block_size, w.num_host_blocks, VOCAB), clock
    )
    requests: dict[str, Request] = {}
    counts: Counter[str] = Counter()
    pending = sorted(w.specs, key=lambda s: s.arrive_step)
    step = 0
    while pending or d.busy():
        while pending and pending[0].arrive_step <= step:
            request = pending.pop(0).build()
            scheduler.add_request(request)
            requests.update({r.request_id: r for r in (request, *request.pending_children)})
        for spec in w.specs:
            if spec.abort_step == step:
                scheduler.finish_requests(spec.abort_id, RequestStatus.FINISHED_ABORTED)
        d.step()
        step += 1
        assert step < 5000, "workload did not finish: scheduler is not live"
    assert_pool_idle(kv)
    counts.update(
        ahead=d.num_ahead,
        dropped=d.num_dropped,
        steps=scheduler.totals.num_steps,
        preemptions_swap=scheduler.totals.preemptions_swap,
        preemptions_recompute=scheduler.totals.preemptions_recompute,
    )
    return scheduler, requests, counts


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_random_workloads_ahead_are_exact(mode: str) -> None:
    """Tiny pools (a third of the steps preempt), shared prefixes, chunked prompts, n > 1,
    EOS / stop ids / min_tokens / max_tokens, priorities and aborts: every request's
    tokens are the oracle's, the FakeRunner's slot checks hold and the pool ends idle."""
    rng = random.Random(f"async-{mode}")
    totals: Counter[str] = Counter()
    for _ in range(NUM_WORKLOADS):
        w = random_workload(rng, mode)
        scheduler, requests, counts = run_async_workload(w)
        totals.update(counts)
        for rid, r in requests.items():
            assert r.is_finished, rid
            oracle = expected_output(r, scheduler, VOCAB)
            if r.status == RequestStatus.FINISHED_ABORTED:
                assert oracle[: r.num_output_tokens] == r.output_token_ids, rid
            else:
                assert r.output_token_ids == oracle, rid
    assert totals["ahead"] >= totals["steps"] // 2, totals
    assert totals["dropped"] > 0, totals
    assert totals[f"preemptions_{mode}"] > 0, totals


def test_forget_unwritten_by_the_steps_block_ids_after_a_preemption() -> None:
    """A request whose step failed but that was preempted since (async scheduling) has no
    table: the step's block ids name the blocks that must leave the prefix cache."""
    kv = KVCacheManager(16, 4)
    a = Request("a", prompt(9, base=6), make_request("x", [1]).sampling_params)
    assert kv.allocate_slots(a, 9) is not None
    step_ids = kv.get_block_ids("a")
    kv.free(a)  # preempted by recompute: its two full blocks stay cached
    twin = Request("t", prompt(9, base=6), a.sampling_params)
    assert kv.get_computed_blocks(twin)[1] == 8
    assert kv.forget_unwritten(a, 0, step_ids) == 2
    assert kv.get_computed_blocks(twin) == ([], 0)
    kv.check_integrity()
    assert_pool_idle(kv)
