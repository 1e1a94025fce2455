"""Stateful (model-based) test of KVCacheManager over random request life cycles.

Besides ``check_integrity()`` after every step, the machine simulates the runtime's bytes:
every device and host slot holds a token "fingerprint" (an interned id of the salt and the
whole prefix up to that token, i.e. what its K/V depends on). The machine carries out the
manager's copy-on-write and swap plans on those slots and, before each simulated forward
pass, checks that every position a request attends to holds the right fingerprint. So a
wrong prefix hit, a leaked salt, a missed copy-on-write or a bad swap plan is caught as a
wrong read, not only as a broken invariant.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=None)
# Fixed prompt heads so that requests often share prefixes (a system prompt, a template).
HEADS = ([], [7] * 8, [5, 6, 7, 8] * 5)


class KVCacheMachine(RuleBasedStateMachine):
    """Random add / admit / step / fork / free / abort / preempt / swap sequences."""

    @initialize(
        num_blocks=st.integers(2, 64),
        block_size=st.sampled_from([1, 4, 16]),
        num_host_blocks=st.integers(0, 24),
        enable_prefix_caching=st.sampled_from([True, True, True, False]),
    )
    def setup(
        self, num_blocks: int, block_size: int, num_host_blocks: int, enable_prefix_caching: bool
    ) -> None:
        self.kv = KVCacheManager(
            num_blocks,
            block_size,
            enable_prefix_caching=enable_prefix_caching,
            num_host_blocks=num_host_blocks,
        )
        self.bs = block_size
        self.device: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.host: list[list[int | None]] = [[None] * block_size for _ in range(num_host_blocks)]
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.num_ids = 0
        self.fingerprints: dict[tuple[object, int], int] = {}
        self.prefix_fps: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ simulated bytes

    def _fps(self, request: Request) -> list[int]:
        """Fingerprint of every position of the request (extended as tokens are added)."""
        fps = self.prefix_fps.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        prev: object = fps[-1] if fps else ("salt", request.cache_salt)
        for token in tokens[len(fps) :]:
            prev = self.fingerprints.setdefault((prev, token), len(self.fingerprints))
            fps.append(prev)
        return fps

    def _check_reads(self, request: Request, num_tokens: int) -> None:
        """Positions [0, num_tokens) must hold the request's own K/V fingerprints."""
        ids = self.kv.get_block_ids(request.request_id)
        fps = self._fps(request)
        bs = self.bs
        assert len(ids) * bs >= num_tokens, "block table does not cover the computed tokens"
        for i in range(-(-num_tokens // bs)):
            n = min(bs, num_tokens - i * bs)
            assert self.device[ids[i]][:n] == fps[i * bs : i * bs + n], (
                f"{request.request_id}: block {ids[i]} (table index {i}) holds wrong K/V"
            )

    def _run_step(self, request: Request, num_new: int) -> None:
        """The runner's part of a step: copies, read check, then write the new K/V."""
        for src, dst in self.kv.take_pending_copies():
            self.device[dst] = list(self.device[src])
        start = request.num_computed_tokens
        self._check_reads(request, start)
        ids = self.kv.get_block_ids(request.request_id)
        assert len(ids) >= self.kv.num_blocks_for(start + num_new), "table is too short"
        fps = self._fps(request)
        for p in range(start, start + num_new):
            self.device[ids[p // self.bs]][p % self.bs] = fps[p]
        request.num_computed_tokens = start + num_new

    @staticmethod
    def _sample(request: Request) -> int:
        """A "sampled" token: differs between forked siblings, costs no hypothesis draw."""
        return (int(request.request_id[1:]) * 31 + request.num_tokens) % 4

    def _unchanged(self, before: dict[str, object]) -> None:
        assert self.kv.dump_state() == before, "a failed operation changed the manager's state"

    # ------------------------------------------------------------------ rules

    @rule(
        head=st.sampled_from(HEADS),
        # NOTE: one binary draw is far cheaper for hypothesis than a list of small ints.
        tail=st.binary(max_size=24),
        salt=st.sampled_from([None, None, "tenant-b"]),
        data=st.data(),
    )
    def add(self, head: list[int], tail: bytes, salt: str | None, data: st.DataObject) -> None:
        """A new request, admitted at once if the blocks allow."""
        prompt = head + [b % 4 for b in tail] or [1]
        self.num_ids += 1
        req = Request(f"r{self.num_ids}", prompt, PARAMS, cache_salt=salt)
        self.waiting.append(req)
        self._admit(req, data)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """Retry a waiting (new or preempted) request."""
        self._admit(self.waiting[data.draw(st.integers(0, len(self.waiting) - 1))], data)

    def _admit(self, req: Request, data: st.DataObject) -> None:
        """get_computed_blocks + first allocate_slots (prefix hits join), then a step."""
        ids, num_hit = self.kv.get_computed_blocks(req)
        assert num_hit == len(ids) * self.bs and num_hit <= req.num_tokens - 1
        assert num_hit == 0 or self.kv.enable_prefix_caching
        num_new = data.draw(st.integers(1, req.num_tokens - num_hit))
        reserve = data.draw(st.integers(0, 2))
        before = self.kv.dump_state()
        if self.kv.allocate_slots(req, num_new, ids, num_hit, reserve=reserve) is None:
            self._unchanged(before)
            return
        req.num_computed_tokens = num_hit
        self._run_step(req, num_new)
        self.waiting.remove(req)
        self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One scheduler step over every running request: a prefill chunk, or (all
        computed) sample a token and decode it. A request whose blocks cannot be had waits."""
        for req in list(self.running):
            if req.num_computed_tokens == req.num_tokens:
                req.output_token_ids.append(self._sample(req))
            remaining = req.num_tokens - req.num_computed_tokens
            num_new = data.draw(st.integers(1, remaining)) if remaining > 1 else 1
            before = self.kv.dump_state()
            if self.kv.allocate_slots(req, num_new) is None:
                self._unchanged(before)
                continue
            self._run_step(req, num_new)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), recompute_last=st.booleans())
    def fork(self, data: st.DataObject, recompute_last: bool) -> None:
        """Parallel sampling: the child shares every block; like the scheduler's fork it may
        recompute the last token (its first write then copies the shared block)."""
        parent = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        self.num_ids += 1
        child = Request(
            f"r{self.num_ids}", list(parent.prompt_token_ids), PARAMS, cache_salt=parent.cache_salt
        )
        child.output_token_ids = list(parent.output_token_ids)
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens - (
            recompute_last and parent.num_computed_tokens > 0
        )
        self.running.append(child)
        assert self.kv.get_block_ids(child.request_id) == self.kv.get_block_ids(
            parent.request_id
        )

    @precondition(lambda self: self.running or self.swapped or self.waiting)
    @rule(data=st.data())
    def finish_or_abort(self, data: st.DataObject) -> None:
        """free() in any state (waiting requests hold nothing: a no-op)."""
        lists = [lst for lst in (self.running, self.swapped, self.waiting) if lst]
        lst = data.draw(st.sampled_from(lists))
        req = lst.pop(data.draw(st.integers(0, len(lst) - 1)))
        self.kv.free(req)
        assert self.kv.get_block_ids(req.request_id) == []
        assert self.kv.num_swapped_blocks(req) == 0
        self.kv.free(req)  # idempotent

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt_recompute(self, data: st.DataObject) -> None:
        req = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.kv.free(req)
        req.num_computed_tokens = 0
        self.waiting.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        req = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        num_blocks = len(self.kv.get_block_ids(req.request_id))
        before = self.kv.dump_state()
        pairs = self.kv.swap_out(req)
        if pairs is None:
            assert num_blocks > before["free_host_ids"].__len__()  # type: ignore[attr-defined]
            self._unchanged(before)
            return
        assert len(pairs) == num_blocks == self.kv.num_swapped_blocks(req)
        for dev, host in pairs:
            self.host[host] = list(self.device[dev])
        self.running.remove(req)
        self.swapped.append(req)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        req = self.swapped[data.draw(st.integers(0, len(self.swapped) - 1))]
        reserve = data.draw(st.integers(0, 2))
        num_swapped = self.kv.num_swapped_blocks(req)
        before = self.kv.dump_state()
        pairs = self.kv.swap_in(req, reserve=reserve)
        if pairs is None:
            self._unchanged(before)
            return
        for host, dev in pairs:
            self.device[dev] = list(self.host[host])
        assert len(self.kv.get_block_ids(req.request_id)) == num_swapped
        self._check_reads(req, req.num_computed_tokens)
        self.swapped.remove(req)
        self.running.append(req)

    @precondition(lambda self: self.kv.prefix_cache.num_cached_blocks and not self.running)
    @rule()
    def reset_prefix_cache(self) -> None:
        """Only running requests hold device blocks, so the reset must succeed."""
        assert self.kv.reset_prefix_cache()
        assert self.kv.prefix_cache.num_cached_blocks == 0

    # ------------------------------------------------------------------ invariants

    @invariant()
    def integrity(self) -> None:
        self.kv.check_integrity()
        snap = self.kv.snapshot()
        assert 0.0 <= snap["kv_usage"] <= 1.0 and 0.0 <= snap["kv_utilization"] <= 1.0
        assert snap["prefix_cache_hits"] <= snap["prefix_cache_queries"]

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for req in self.running + self.swapped + self.waiting:
            self.kv.free(req)
        self.kv.check_integrity()
        pool = self.kv.block_pool
        assert self.kv.num_free_blocks == self.kv.num_blocks, "blocks leaked"
        assert all(b.ref_cnt == 0 for b in pool.blocks), "a block kept a reference"
        assert self.kv.num_free_host_blocks == self.kv.num_host_blocks, "host blocks leaked"
        assert self.kv.usage == 0.0 and self.kv.snapshot()["kv_utilization"] == 0.0


KVCacheMachine.TestCase.settings = settings(
    max_examples=2000, stateful_step_count=30, deadline=None
)
TestKVCacheMachine = KVCacheMachine.TestCase
