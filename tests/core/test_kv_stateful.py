"""Stateful (model-based) test of KVCacheManager over random request life cycles.

Besides ``check_integrity()`` after every step, the machine simulates the runtime's bytes:
every device and host slot holds a token "fingerprint" (an interned id of the salt and the
whole prefix up to that token, i.e. what its K/V depends on). The machine carries out the
manager's copy-on-write and swap plans on those slots and, before each simulated forward
pass, checks that every position a request attends to holds the right fingerprint. So a
wrong prefix hit, a leaked salt, a missed copy-on-write or a bad swap plan is caught as a
wrong read, not only as a broken invariant. With the host prefix tier on, offloads and
loads are carried out in the runner's order (every swap-out, then every swap-in, then the
copies), so a plan that reuses a host block within a step is caught the same way.

Speculative decoding (``speculate``): a decoding request takes its known token plus draft
slots (all or nothing), the drafts' K/V is written, a random number of drafts is accepted,
and the blocks that held only rejected ones must go back to the pool, exactly those; the
accepted drafts' slots must then read as the request's own K/V, and no draft ever reaches
the prefix cache (``check_integrity`` while the lookahead is held, and every read after).
It interleaves with preemption, swap, fork and abort (an abort may come mid-step).
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from tests.examples import examples

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
        host_tier=st.booleans(),
    )
    def setup(
        self,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int,
        enable_prefix_caching: bool,
        host_tier: bool,
    ) -> None:
        self.kv = KVCacheManager(
            num_blocks,
            block_size,
            enable_prefix_caching=enable_prefix_caching,
            num_host_blocks=num_host_blocks,
            enable_host_prefix_cache=host_tier and enable_prefix_caching and num_host_blocks > 0,
        )
        self.bs = block_size
        self.device: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.host: list[list[int | None]] = [[None] * block_size for _ in range(num_host_blocks)]
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.num_ids = 0
        self.histories: list[tuple[list[int], str | None]] = []  # finished requests' tokens
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

    def _cached_ids(self, request: Request) -> set[int]:
        """The request's blocks that are in the prefix cache (taken before an allocation)."""
        blocks = self.kv.block_pool.blocks
        return {i for i in self.kv.get_block_ids(request.request_id) if blocks[i].is_cached}

    def _execute(
        self,
        swap_out: list[tuple[int, int]] | None = None,
        swap_in: list[tuple[int, int]] | None = None,
    ) -> None:
        """The runner's data movement for a step: the given swap plans plus the manager's
        pending offloads / loads / copies, in the runner's order."""
        offloads, loads = self.kv.take_pending_swaps()
        copies = self.kv.take_pending_copies()
        outs = (swap_out or []) + offloads
        assert len({h for _, h in outs}) == len(outs), f"two swap-outs write one host block {outs}"
        for dev, host in outs:
            self.host[host] = list(self.device[dev])
        for host, dev in (swap_in or []) + loads:
            self.device[dev] = list(self.host[host])
        for src, dst in copies:
            self.device[dst] = list(self.device[src])

    def _run_step(self, request: Request, num_new: int, cached_before: set[int]) -> None:
        """The runner's part of a step: copies, read check, then write the new K/V.

        ``cached_before``: blocks cached before the allocation. Cached blocks are immutable,
        so none of them may be written (blocks cached by the allocation itself are written
        in the same step, which the contract allows).
        """
        self._execute()
        start = request.num_computed_tokens
        self._check_reads(request, start)
        ids = self.kv.get_block_ids(request.request_id)
        assert len(ids) >= self.kv.num_blocks_for(start + num_new), "table is too short"
        fps = self._fps(request)
        for p in range(start, start + num_new):
            block_id = ids[p // self.bs]
            assert block_id not in cached_before, f"write into cached block {block_id}"
            self.device[block_id][p % self.bs] = fps[p]
        request.num_computed_tokens = start + num_new

    @staticmethod
    def _sample(request: Request) -> int:
        """A "sampled" token: differs between forked siblings, costs no hypothesis draw."""
        return (int(request.request_id[1:]) * 31 + request.num_tokens) % 4

    def _state_if_may_fail(
        self, num_total: int, reserve: int, num_held: int = 0
    ) -> dict[str, object] | None:
        """The manager's full state, taken only if an allocation could fail.

        NOTE: covering num_total tokens with a table of num_held blocks takes at most
        max(num_blocks_for(num_total), num_held) fresh blocks (new ones plus copy-on-write
        replacements); skipping the dump when that many are free keeps the 2,000 examples
        fast, and a failure then is itself a bug.
        """
        num_fresh_max = max(self.kv.num_blocks_for(num_total), num_held)
        if self.kv.num_free_blocks >= num_fresh_max + reserve:
            return None
        return self.kv.dump_state()

    def _unchanged(self, before: dict[str, object] | None) -> None:
        assert before is not None, "an allocation failed although enough blocks were free"
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

    @rule(tail=st.binary(min_size=1, max_size=8), data=st.data())
    def follow_up(self, tail: bytes, data: st.DataObject) -> None:
        """Multi-turn chat: a finished request's whole history plus a new turn, so its
        blocks are matched again after they may have been evicted (or offloaded)."""
        if not self.histories:
            self._pick([], data)  # adds a request instead
            return
        tokens, salt = self.histories[data.draw(st.integers(0, len(self.histories) - 1))]
        self.num_ids += 1
        req = Request(f"r{self.num_ids}", tokens + [b % 4 for b in tail], PARAMS, cache_salt=salt)
        self.waiting.append(req)
        self._admit(req, data)

    def _pick(self, lst: list[Request], data: st.DataObject) -> Request | None:
        """A random element of ``lst``; if it is empty, add a request instead (None).

        NOTE: rules fall back to adding rather than using preconditions: with swarm
        testing, preconditions left more than half of the generated cases invalid.
        """
        if lst:
            return lst[data.draw(st.integers(0, len(lst) - 1))]
        self.add(
            data.draw(st.sampled_from(HEADS)),
            data.draw(st.binary(max_size=24)),
            data.draw(st.sampled_from([None, "tenant-b"])),
            data,
        )
        return None

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """Retry a waiting (new or preempted) request."""
        req = self._pick(self.waiting, data)
        if req is not None:
            self._admit(req, data)

    def _admit(self, req: Request, data: st.DataObject) -> None:
        """get_computed_blocks + first allocate_slots (prefix hits join), then a step."""
        ids, num_hit = self.kv.get_computed_blocks(req)
        assert num_hit == len(ids) * self.bs and num_hit <= req.num_tokens - 1
        assert num_hit == 0 or self.kv.enable_prefix_caching
        num_new = data.draw(st.integers(1, req.num_tokens - num_hit))
        reserve = data.draw(st.integers(0, 2))
        before = self._state_if_may_fail(num_hit + num_new, reserve)
        if self.kv.allocate_slots(req, num_new, ids, num_hit, reserve=reserve) is None:
            self._unchanged(before)
            return
        req.num_computed_tokens = num_hit
        self._run_step(req, num_new, set(ids))
        self.waiting.remove(req)
        self.running.append(req)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One scheduler step over every running request: a prefill chunk, or (all
        computed) sample a token and decode it. A request whose blocks cannot be had waits."""
        if not self.running:
            self._pick(self.running, data)  # adds a request instead
            return
        for req in list(self.running):
            if req.num_computed_tokens == req.num_tokens:
                req.output_token_ids.append(self._sample(req))
            remaining = req.num_tokens - req.num_computed_tokens
            num_new = data.draw(st.integers(1, remaining)) if remaining > 1 else 1
            num_held = len(self.kv.get_block_ids(req.request_id))
            before = self._state_if_may_fail(req.num_computed_tokens + num_new, 0, num_held)
            cached_before = self._cached_ids(req)
            if self.kv.allocate_slots(req, num_new) is None:
                self._unchanged(before)
                continue
            self._run_step(req, num_new, cached_before)

    @rule(data=st.data(), drafts=st.binary(min_size=1, max_size=5))
    def speculate(self, data: st.DataObject, drafts: bytes) -> None:
        """A speculative decoding step of one decoding request (see the module docstring)."""
        req = self._pick(self.running, data)
        if req is None:
            return
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(self._sample(req))
        start = req.num_computed_tokens
        if req.num_tokens - start != 1:
            return  # still prefilling: the scheduler drafts for decodes only
        draft, bs = [b % 4 for b in drafts], self.bs
        num_held = len(self.kv.get_block_ids(req.request_id))
        before = self._state_if_may_fail(start + 1 + len(draft), 0, num_held)
        cached_before = self._cached_ids(req)
        if self.kv.allocate_slots(req, 1 + len(draft)) is None:
            self._unchanged(before)
            return
        self.kv.set_lookahead(req, len(draft))
        self.kv.check_integrity()
        self._execute()
        self._check_reads(req, start)
        ids = self.kv.get_block_ids(req.request_id)
        assert len(ids) == self.kv.num_blocks_for(start + 1 + len(draft))
        prev = self._fps(req)[start]
        for p, fp in enumerate([prev], start):
            self.device[ids[p // bs]][p % bs] = fp
        for p, token in enumerate(draft, start + 1):
            prev = self.fingerprints.setdefault((prev, token), len(self.fingerprints))
            assert ids[p // bs] not in cached_before, (
                f"draft written into cached block {ids[p // bs]}"
            )
            self.device[ids[p // bs]][p % bs] = prev
        if data.draw(st.integers(0, 9)) == 0:  # aborted before its step is applied
            self.running.remove(req)
            self.kv.free(req)
            return
        num_accepted = data.draw(st.integers(0, len(draft)))
        verified = start + 1 + num_accepted
        keep = self.kv.num_blocks_for(verified)
        num_free = self.kv.num_free_blocks
        freed = self.kv.release_rejected(req, verified)
        assert freed == ids[keep:], "not exactly the blocks past the verified tokens"
        assert self.kv.get_block_ids(req.request_id) == ids[:keep]
        assert self.kv.num_free_blocks == num_free + len(freed), "a rejected block was kept"
        assert all(self.kv.block_pool.blocks[i].ref_cnt == 0 for i in freed)
        req.output_token_ids.extend(draft[:num_accepted])
        req.num_computed_tokens = verified
        self._check_reads(req, verified)
        req.output_token_ids.append(self._sample(req))

    @rule(data=st.data(), recompute_last=st.booleans())
    def fork(self, data: st.DataObject, recompute_last: bool) -> None:
        """Parallel sampling: the child shares every block; like the scheduler's fork it may
        recompute the last token (its first write then copies the shared block)."""
        parent = self._pick(self.running, data)
        if parent is None:
            return
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
        assert self.kv.get_block_ids(child.request_id) == self.kv.get_block_ids(parent.request_id)

    @rule(data=st.data())
    def finish_or_abort(self, data: st.DataObject) -> None:
        """free() in any state (waiting requests hold nothing: a no-op)."""
        lists = [lst for lst in (self.running, self.swapped, self.waiting) if lst]
        lst = data.draw(st.sampled_from(lists)) if lists else []
        req = self._pick(lst, data)
        if req is None:
            return
        lst.remove(req)
        self.kv.free(req)
        if req.num_computed_tokens:
            self.histories.append((req.all_token_ids, req.cache_salt))
        assert self.kv.get_block_ids(req.request_id) == []
        assert self.kv.num_swapped_blocks(req) == 0
        self.kv.free(req)  # idempotent

    @rule(data=st.data())
    def preempt_recompute(self, data: st.DataObject) -> None:
        req = self._pick(self.running, data)
        if req is None:
            return
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        self.waiting.append(req)

    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        req = self._pick(self.running, data)
        if req is None:
            return
        num_blocks = len(self.kv.get_block_ids(req.request_id))
        before = self.kv.dump_state()
        pairs = self.kv.swap_out(req)
        if pairs is None:
            assert num_blocks > self.kv.num_free_host_blocks
            self._unchanged(before)
            return
        assert len(pairs) == num_blocks == self.kv.num_swapped_blocks(req)
        self._execute(swap_out=pairs)
        self.running.remove(req)
        self.swapped.append(req)

    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        req = self._pick(self.swapped, data)
        if req is None:
            return
        reserve = data.draw(st.integers(0, 2))
        num_swapped = self.kv.num_swapped_blocks(req)
        before = self.kv.dump_state()
        pairs = self.kv.swap_in(req, reserve=reserve)
        if pairs is None:
            self._unchanged(before)
            return
        self._execute(swap_in=pairs)
        assert len(self.kv.get_block_ids(req.request_id)) == num_swapped
        self._check_reads(req, req.num_computed_tokens)
        self.swapped.remove(req)
        self.running.append(req)

    @rule()
    def reset_prefix_cache(self) -> None:
        """Succeeds exactly when no request runs (only running requests hold blocks)."""
        num_cached = self.kv.prefix_cache.num_cached_blocks
        idle = not self.running
        assert self.kv.reset_prefix_cache() == idle
        assert self.kv.prefix_cache.num_cached_blocks == (0 if idle else num_cached)

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
    max_examples=examples(500), stateful_step_count=30, deadline=None
)
TestKVCacheMachine = KVCacheMachine.TestCase


class HostTierMachine(KVCacheMachine):
    """The same machine with the host prefix tier always on and a pool small enough that
    cached blocks are evicted (offloaded) often and follow-ups load them back."""

    @initialize(
        num_blocks=st.integers(2, 12),
        block_size=st.sampled_from([1, 2, 4]),
        num_host_blocks=st.integers(1, 24),
    )
    def setup(self, num_blocks: int, block_size: int, num_host_blocks: int) -> None:  # type: ignore[override]
        super().setup(num_blocks, block_size, num_host_blocks, True, True)


HostTierMachine.TestCase.settings = settings(
    max_examples=examples(150), stateful_step_count=30, deadline=None
)
TestHostTierMachine = HostTierMachine.TestCase
