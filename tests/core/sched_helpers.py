"""Shared by the scheduler tests: a scheduler over a real KVCacheManager driven by the
FakeRunner (tests/core/fake_runner.py), prompts, and what to check of a run."""

from __future__ import annotations

from kvserve.config import SchedulerConfig
from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.sched.policy import PreemptionPolicy
from kvserve.core.sched.scheduler import Scheduler
from kvserve.request import Request
from tests.core.fake_runner import Driver, FakeClock, FakeRunner, expected_output, make_request

VOCAB = 50


def make_driver(
    num_blocks: int = 16,
    block_size: int = 4,
    *,
    num_host_blocks: int = 0,
    enable_prefix_caching: bool = True,
    policy: PreemptionPolicy | None = None,
    **config: object,
) -> Driver:
    settings: dict = dict(
        max_num_seqs=8,
        max_num_batched_tokens=16,
        max_model_len=256,
        admission_headroom=0.0,
    )
    settings.update(config)
    settings.setdefault("resume_watermark", settings["admission_headroom"])
    kv = KVCacheManager(
        num_blocks,
        block_size,
        enable_prefix_caching=enable_prefix_caching,
        num_host_blocks=num_host_blocks,
    )
    clock = FakeClock()
    scheduler = Scheduler(SchedulerConfig(**settings), kv, policy=policy, clock=clock)
    return Driver(scheduler, FakeRunner(num_blocks, block_size, num_host_blocks, VOCAB), clock)


def prompt(n: int, base: int = 0) -> list[int]:
    return [(base * 7 + 3 * i + 1) % VOCAB for i in range(n)]


def scheduled_ids(d: Driver, step: int) -> set[str]:
    return {sr.request_id for sr in d.outputs[step].scheduled}


def first_step_of(d: Driver, request_id: str) -> int:
    return next(
        i for i, o in enumerate(d.outputs) if request_id in {s.request_id for s in o.scheduled}
    )


def assert_expected(d: Driver, *requests: Request) -> None:
    for r in requests:
        assert r.output_token_ids == expected_output(r, d.scheduler, VOCAB), r.request_id


def pressure_pair(d: Driver) -> tuple[Request, Request]:
    """A and B both grow to 5 blocks in a 6-block pool: B (later) gets preempted."""
    a = make_request("a", prompt(8), max_tokens=12)
    b = make_request("b", prompt(8, base=1), max_tokens=12)
    d.scheduler.add_request(a)
    d.scheduler.add_request(b)
    return a, b


def first_preemption(d: Driver) -> int:
    while not d.scheduler.totals.preemptions:
        d.step()
    return len(d.outputs) - 1
