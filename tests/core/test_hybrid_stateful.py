"""Stateful test of HybridKVCacheManager: random admit / step / fork / swap / free sequences.

Like ``test_kv_stateful.py``, the machine simulates the runtime's bytes: every device and
host slot holds a fingerprint of (group, salt, the whole prefix up to that token). It
carries out the manager's copy-on-write and swap plans and, before each simulated forward
pass, checks that every key a group's queries read holds the right fingerprint: a prefix
hit on a block some group lacks, a window freed too early or a bad swap plan is caught as a
wrong read. After every rule: ``check_integrity`` (no leaked block: ref counts = holders)
and, for the requests a step scheduled, each sliding group's window bound.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvserve.core.kv.hybrid import HybridKVCacheManager
from kvserve.core.kv.hybrid_prefix import first_needed
from kvserve.core.kv.kv_groups import KVGroupSpec, window_blocks
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from tests.examples import examples

PARAMS = SamplingParams(max_tokens=None)
HEADS = ([], [7] * 8, [5, 6, 7, 8] * 5)
NULL = -1


class HybridMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(6, 96),
        block_size=st.sampled_from([1, 2, 4]),
        windows=st.lists(st.integers(1, 12), min_size=1, max_size=3),
        full_first=st.booleans(),
        num_host_blocks=st.integers(0, 24),
        caching=st.sampled_from([True, True, False]),
    )
    def setup(
        self,
        num_blocks: int,
        block_size: int,
        windows: list[int],
        full_first: bool,
        num_host_blocks: int,
        caching: bool,
    ) -> None:
        groups = [KVGroupSpec((i,), w) for i, w in enumerate(windows)]
        if full_first:
            groups.insert(0, KVGroupSpec((len(windows),)))
        self.groups = groups
        self.kv = HybridKVCacheManager(
            num_blocks,
            block_size,
            groups,
            enable_prefix_caching=caching,
            num_host_blocks=num_host_blocks,
        )
        self.bs = block_size
        self.device: list[list[object]] = [[None] * block_size for _ in range(num_blocks)]
        self.host: list[list[object]] = [[None] * block_size for _ in range(num_host_blocks)]
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.swapped: list[Request] = []
        self.num_ids = 0

    # ------------------------------------------------------------------ simulated bytes

    def _fp(self, request: Request, g: int, pos: int) -> object:
        return (g, request.cache_salt, tuple(request.token_ids_slice(0, pos + 1)))

    def _slot(self, table: list[int], pos: int) -> tuple[int, int]:
        block = table[pos // self.bs]
        assert block != NULL, f"position {pos} is read or written through a freed entry"
        return block, pos % self.bs

    def _forward(self, request: Request, n: int) -> None:
        """Check every key the chunk's queries read, then write the chunk's keys."""
        tables = self.kv.get_group_block_ids(request.request_id)
        assert tables is not None
        c = request.num_computed_tokens
        for g, (spec, table) in enumerate(zip(self.groups, tables, strict=True)):
            assert len(table) * self.bs >= c + n
            lo = 0 if spec.window is None else max(0, c - spec.window + 1)
            for pos in range(lo, c):
                b, o = self._slot(table, pos)
                assert self.device[b][o] == self._fp(request, g, pos), (g, pos)
            for pos in range(c, c + n):
                b, o = self._slot(table, pos)
                self.device[b][o] = self._fp(request, g, pos)
            if spec.window is not None:
                live = sum(1 for b in table if b != NULL)
                assert live <= window_blocks(spec.window, self.bs, n), (live, spec.window, n)

    def _apply(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.device[dst] = list(self.device[src])

    # ------------------------------------------------------------------ rules

    @rule(
        head=st.sampled_from(HEADS),
        tail=st.lists(st.integers(0, 9), max_size=12),
        salt=st.sampled_from([None, None, "t"]),
        chunk=st.integers(1, 40),
        num_children=st.integers(0, 2),
    )
    def add(
        self, head: list[int], tail: list[int], salt: str | None, chunk: int, num_children: int
    ) -> None:
        """A new request, admitted at once (after any queued before it) when it fits."""
        prompt = head + tail or [1]
        self.num_ids += 1
        self.waiting.append(Request(f"r{self.num_ids}", prompt, PARAMS, cache_salt=salt))
        self.admit(chunk, num_children)

    @rule(chunk=st.integers(1, 9), num_children=st.integers(0, 2))
    def admit(self, chunk: int, num_children: int = 0) -> None:
        if not self.waiting:
            return
        r = self.waiting[0]
        ids, num_hit = self.kv.get_computed_blocks(r)
        n = min(chunk, r.num_tokens - num_hit)
        if self.kv.allocate_slots(r, n, ids, num_hit) is None:
            return
        self.waiting.pop(0)
        r.num_computed_tokens = num_hit
        self.running.append(r)
        # A hit holds, in every group, the blocks its next token reads (and only those).
        h = num_hit // self.bs
        tables = self.kv.get_group_block_ids(r.request_id) or []
        for spec, table in zip(self.groups, tables, strict=True):
            first = 0 if spec.window is None else first_needed(h, spec.window, self.bs)
            assert table[:first] == [NULL] * first and NULL not in table[first:h]
        self._step([(r, n)], num_children)

    @rule(chunk=st.integers(1, 9), data=st.data(), num_children=st.integers(0, 2))
    def step(self, chunk: int, data: st.DataObject, num_children: int) -> None:
        if not self.running:
            return
        picked = data.draw(st.lists(st.sampled_from(self.running), unique_by=id, min_size=1))
        plan = []
        for r in picked:
            n = min(chunk, r.num_tokens - r.num_computed_tokens)
            if n and self.kv.allocate_slots(r, n) is not None:
                plan.append((r, n))
        self._step(plan, num_children)

    def _step(self, plan: list[tuple[Request, int]], num_children: int = 0) -> None:
        for r, _ in plan:
            self.kv.remove_skipped_blocks(r)
        self._apply(self.kv.take_pending_copies())
        for r, n in plan:
            self._forward(r, n)
            r.num_computed_tokens += n
            if r.num_computed_tokens == r.num_tokens:
                if not r.output_token_ids:
                    self._fork(r, num_children)
                r.output_token_ids.append(r.num_tokens % 7)

    def _fork(self, parent: Request, num_children: int) -> None:
        """n > 1 as the scheduler does it: once the prompt is computed, each child shares the
        parent's tables and recomputes the last prompt token (copy-on-write)."""
        for _ in range(num_children):
            self.num_ids += 1
            child = Request(
                f"r{self.num_ids}", parent.prompt_token_ids, PARAMS, cache_salt=parent.cache_salt
            )
            self.kv.fork(parent, child)
            child.num_computed_tokens = child.num_tokens - 1
            self.running.append(child)

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        pool = self.running + self.swapped
        if pool:
            r = data.draw(st.sampled_from(pool))
            self.kv.free(r)
            (self.running if r in self.running else self.swapped).remove(r)

    @rule(data=st.data())
    def preempt_recompute(self, data: st.DataObject) -> None:
        if self.running:
            r = data.draw(st.sampled_from(self.running))
            self.kv.free(r)
            self.running.remove(r)
            r.num_computed_tokens = 0
            self.waiting.insert(0, r)

    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        if not self.running:
            return
        r = data.draw(st.sampled_from(self.running))
        pairs = self.kv.swap_out(r)
        if pairs is None:
            return
        for dev, host in pairs:
            self.host[host] = list(self.device[dev])
        self.running.remove(r)
        self.swapped.append(r)

    @rule()
    def swap_in(self) -> None:
        if not self.swapped:
            return
        r = self.swapped[0]
        pairs = self.kv.swap_in(r)
        if pairs is None:
            return
        for host, dev in pairs:
            self.device[dev] = list(self.host[host])
        self.swapped.pop(0)
        self.running.append(r)

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "kv"):
            self.kv.check_integrity()
            if not self.running and not self.swapped:
                assert self.kv.num_free_blocks == self.kv.num_blocks  # nothing leaked


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(
    max_examples=examples(60), stateful_step_count=30, deadline=None
)
