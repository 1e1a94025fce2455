"""Test helpers: hand-built ModelRunnerOutputs and a fake runner over a simulated paged cache.

``FakeRunner`` stands in for the model: instead of K/V vectors each cache slot holds a hash
of the whole token prefix up to its position, computed *through the cache* (slot p =
mix(slot p-1, token p)), exactly as attention would read earlier K/V through the block table.
Swaps and copies are carried out on these slots. A sampled token is a function of the
last slot and the request's seed only. So any scheduling or block-table mistake (wrong
positions, a stale or foreign prefix-cache block, a missed copy-on-write, a lost swap)
changes the tokens, and the runner also asserts every slot against the true prefix.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from kvserve.core.sched.scheduler import Scheduler
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

_MOD = (1 << 61) - 1
_ROOT = 1469598103


def mix(prev: int, token_id: int) -> int:
    """The simulated K/V of a token given the simulated K/V of the position before it."""
    return (prev * 1_000_003 + token_id + 7) % _MOD


def prefix_state(token_ids: list[int]) -> int:
    """The slot value a correct cache holds after ``token_ids``."""
    h = _ROOT
    for t in token_ids:
        h = mix(h, t)
    return h


def sample_from(state: int, seed: int | None, vocab_size: int) -> int:
    """The token the fake model samples after a prefix with slot value ``state``."""
    if seed is not None:
        state = mix(state, 100_003 + seed)
    # splitmix64 finaliser: nearby states give unrelated tokens.
    z = (state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) % vocab_size


def next_token(token_ids: list[int], seed: int | None, vocab_size: int) -> int:
    """What an uncached, unbatched run would sample after ``token_ids``."""
    return sample_from(prefix_state(token_ids), seed, vocab_size)


def runner_output(sampled: dict[str, int]) -> ModelRunnerOutput:
    """A hand-built ModelRunnerOutput with the given sampled token per request id."""
    return ModelRunnerOutput(sampled_token_ids=dict(sampled))


def sampling_ids(sched: SchedulerOutput) -> list[str]:
    """Ids of the scheduled requests whose ``sample`` flag is set."""
    return [sr.request_id for sr in sched.scheduled if sr.sample]


class FakeRunner:
    """Executes SchedulerOutputs on a simulated paged KV cache (see the module docstring)."""

    def __init__(
        self, num_blocks: int, block_size: int, num_host_blocks: int = 0, vocab_size: int = 50
    ) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.host: list[list[int | None]] = [[None] * block_size for _ in range(num_host_blocks)]
        self.num_steps = 0

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Swap out, swap in, copy, then write and sample, checking every slot on the way."""
        for dev, host in sched.blocks_to_swap_out:
            self.host[host] = list(self.device[dev])
        for host, dev in sched.blocks_to_swap_in:
            self.device[dev] = list(self.host[host])
        for src, dst in sched.blocks_to_copy:
            self.device[dst] = list(self.device[src])
        out = ModelRunnerOutput()
        for sr in sched.scheduled:
            state = self._run(sr)
            if sr.sample:
                out.sampled_token_ids[sr.request_id] = sample_from(state, sr.seed, self.vocab_size)
        self.num_steps += 1
        return out

    def _slot(self, block_ids: list[int], pos: int) -> tuple[int, int]:
        return block_ids[pos // self.block_size], pos % self.block_size

    def _run(self, sr: ScheduledRequest) -> int:
        known = sr.prompt_token_ids + sr.output_token_ids
        start, end = sr.start_pos, sr.start_pos + sr.num_tokens
        rid = sr.request_id
        assert sr.num_tokens > 0, f"{rid}: empty schedule"
        assert sr.token_ids == known[start:end], f"{rid}: token_ids are not tokens [{start}, {end})"
        assert sr.sample == (end == len(known)), f"{rid}: sample flag wrong at end={end}"
        assert len(sr.block_ids) * self.block_size >= end, f"{rid}: block table too short"
        assert len(set(sr.block_ids)) == len(sr.block_ids), f"{rid}: block repeated in table"
        state = _ROOT
        if start > 0:
            b, o = self._slot(sr.block_ids, start - 1)
            state = self.device[b][o]
            assert state == prefix_state(known[:start]), f"{rid}: cached prefix wrong at {start}"
        for pos in range(start, end):
            state = mix(state, known[pos])
            b, o = self._slot(sr.block_ids, pos)
            self.device[b][o] = state
        return state


class FakeClock:
    """An injectable clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


_arrivals = itertools.count()


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    *,
    max_tokens: int | None = 8,
    priority: int = 0,
    arrival_time: float | None = None,
    n: int = 1,
    eos_token_id: int | None = None,
    seed: int | None = None,
    **params: object,
) -> Request:
    """A greedy request; for n > 1 its samples 1..n-1 ride in ``pending_children``."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n, seed=seed, **params)
    arrival = float(next(_arrivals)) if arrival_time is None else arrival_time

    def one(rid: str, index: int) -> Request:
        return Request(
            rid,
            list(prompt_token_ids),
            sp,
            eos_token_id=eos_token_id,
            arrival_time=arrival,
            priority=priority,
            parent_id=None if index == 0 else request_id,
            sample_index=index,
        )

    parent = one(request_id, 0)
    parent.pending_children = [one(f"{request_id}#{i}", i) for i in range(1, n)]
    return parent


class Driver:
    """Runs schedule -> FakeRunner.execute -> update_from_output, checking invariants each step.

    Checked every step: the token budget and max_running, unique scheduled ids, and the KV
    manager's ``check_integrity()`` (after schedule and after update; ``check_integrity=False``
    skips it, e.g. for a reference run). ``on_step`` (if set) runs after each update.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        runner: FakeRunner,
        clock: FakeClock,
        *,
        check_integrity: bool = True,
    ) -> None:
        self.scheduler = scheduler
        self.check_integrity = check_integrity
        self.runner = runner
        self.clock = clock
        self.outputs: list[SchedulerOutput] = []
        self.on_step: Callable[[SchedulerOutput, list[Request]], None] | None = None

    def step(self) -> tuple[SchedulerOutput, list[Request]]:
        s = self.scheduler
        sched = s.schedule()
        cfg = s.config
        assert sched.total_num_scheduled_tokens <= cfg.max_num_batched_tokens, "budget exceeded"
        ids = [sr.request_id for sr in sched.scheduled]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        assert s.num_running <= cfg.max_running, "max_running (max_num_seqs, budget) exceeded"
        if self.check_integrity:
            s.kv.check_integrity()
        touched = s.update_from_output(sched, self.runner.execute(sched))
        if self.check_integrity:
            s.kv.check_integrity()
        self.clock.now += 1.0
        self.outputs.append(sched)
        if self.on_step is not None:
            self.on_step(sched, touched)
        return sched, touched

    def run(self, max_steps: int = 10_000) -> int:
        """Step until no request is left; returns the number of steps. Fails if it hangs."""
        for num_steps in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return num_steps
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")


def assert_pool_idle(kv: KVCacheManager) -> None:
    """No leak: every block free, nothing referenced, host tier empty, integrity holds."""
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks, f"leak: {kv.num_free_blocks}/{kv.num_blocks} free"
    assert kv.usage == 0.0
    assert kv.num_free_host_blocks == kv.num_host_blocks


def expected_output(request: Request, scheduler: Scheduler, vocab_size: int) -> list[int]:
    """The tokens ``request`` yields run alone, uncached, unpressured: the oracle for tests.

    Applies the scheduler's stop rules: EOS / stop_token_ids after min_tokens, max_tokens,
    max_model_len, and a next token whose KV would need more blocks than the pool.
    """
    params = request.sampling_params
    seed = None if params.seed is None else params.seed + request.sample_index
    token_ids = list(request.prompt_token_ids)
    out: list[int] = []
    kv, max_model_len = scheduler.kv, scheduler.config.max_model_len
    while True:
        token = next_token(token_ids, seed, vocab_size)
        out.append(token)
        token_ids.append(token)
        if len(out) >= params.min_tokens:
            if not params.ignore_eos and token == request.eos_token_id:
                return out
            if token in (params.stop_token_ids or ()):
                return out
        if params.max_tokens is not None and len(out) >= params.max_tokens:
            return out
        if len(token_ids) >= max_model_len or kv.num_blocks_for(len(token_ids)) > kv.num_blocks:
            return out
