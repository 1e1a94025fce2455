"""StructuredOutputManager: one grammar matcher per constrained sequence, on the engine side.

Life cycle of a matcher, keyed by request id (core/ and the runner never see one):
- ``add_request``: compiled once per distinct constraint (GrammarCompiler's cache); the
  first sample gets a copy of the compiled matcher and each n > 1 sample a ``deep_copy`` of
  the first one's (forks copy the matcher state).
- ``prepare`` (before the forward): each constrained request that samples this step gets a
  row of the step's allowed-token bitmask, handed to the runner as plain data
  (``SchedulerOutput.grammar_bitmask``).
- ``update`` (after the scheduler appended the sampled tokens): the matcher consumes them.
- recompute preemption drops the matcher; it is rebuilt from the tokens already generated
  when the request runs again. A swapped-out request keeps its matcher. ``free`` (finish,
  abort) releases it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvserve.core.outputs import GrammarBitmask, SchedulerOutput
from kvserve.request import Request, RequestStatus
from kvserve.structured.compiler import DEFAULT_CACHE_SIZE, GrammarCompiler
from kvserve.structured.spec import StructuredOutputsParams


@dataclass(slots=True)
class _SeqGrammar:
    """A sequence's matcher and how many of its output tokens it has consumed."""

    matcher: Any  # llguidance.LLMatcher
    num_consumed: int = 0


@dataclass(slots=True)
class StructuredStats:
    """Counters for tests and benchmarks."""

    num_rebuilt: int = 0  # matchers rebuilt after a recompute preemption
    num_forked: int = 0  # n > 1 samples given a copy of the first sample's matcher
    num_rejected_tokens: int = 0  # sampled tokens the grammar refused (should stay 0)
    num_masked_rows: int = 0
    mask_seconds: float = 0.0


class StructuredOutputManager:
    """Matchers and bitmasks for the constrained requests of one engine.

    Args:
        hf_tokenizer: the model's fast Hugging Face tokenizer.
        vocab_size: logits columns of the model.
        eos_token_id: the end token a finished grammar allows.
        cache_size: compiled constraints kept (GrammarCompiler).
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_id: int | None,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.cache_size = cache_size
        self._compiler: GrammarCompiler | None = None
        self._specs: dict[str, StructuredOutputsParams] = {}
        self._states: dict[str, _SeqGrammar] = {}
        self.stats = StructuredStats()
        self._num_words = (vocab_size + 31) // 32

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar compiler (its tokenizer is built on first use, ~0.5 s)."""
        if self._compiler is None:
            self._compiler = GrammarCompiler(
                self._hf_tokenizer, self.vocab_size, self.eos_token_id, self.cache_size
            )
        return self._compiler

    @property
    def num_matchers(self) -> int:
        """Matchers held now (running or swapped constrained sequences)."""
        return len(self._states)

    def has(self, request_id: str) -> bool:
        return request_id in self._specs

    def validate(self, spec: StructuredOutputsParams) -> None:
        """Compile ``spec`` (into the cache); ValueError naming the problem if it is invalid."""
        self.compiler.compile(spec)

    def add_request(self, request_ids: list[str], spec: StructuredOutputsParams) -> None:
        """Matchers for the samples ``request_ids`` (first one first). Raises ValueError
        before registering anything when ``spec`` cannot be compiled."""
        first = self.compiler.compile(spec)
        for i, rid in enumerate(request_ids):
            self._specs[rid] = spec
            if i == 0:
                self._states[rid] = _SeqGrammar(first)
            else:
                self._states[rid] = _SeqGrammar(first.deep_copy())
                self.stats.num_forked += 1

    def free(self, request_id: str) -> None:
        """Forget a finished or aborted sequence (unknown ids are ignored)."""
        self._specs.pop(request_id, None)
        self._states.pop(request_id, None)

    # ---- per step ---------------------------------------------------------------------------

    def prepare(self, sched: SchedulerOutput, get_request: Callable[[str], Request | None]) -> None:
        """Drop the matchers of requests this step preempted for recompute, then set
        ``sched.grammar_bitmask`` for the constrained requests that sample (None if none)."""
        if not self._specs:
            return
        for rid in sched.preempted_req_ids:
            req = get_request(rid)
            if req is not None and req.status == RequestStatus.PREEMPTED:
                self._states.pop(rid, None)
        rows = [sr for sr in sched.scheduled if sr.sample and sr.request_id in self._specs]
        if not rows:
            return
        t0 = time.perf_counter()
        bitmask = np.zeros((len(rows), self._num_words), dtype=np.int32)  # [G, ceil(V/32)]
        for i, sr in enumerate(rows):
            state = self._sync(sr.request_id, sr.output_token_ids)
            matcher = state.matcher
            if not (matcher.is_error() or matcher.is_stopped()):
                row = bitmask[i]
                matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        # NOTE: a matcher in an error state, stopped, or with nothing allowed gets EOS only:
        # the request ends instead of sampling from an empty distribution.
        empty = ~bitmask.any(axis=1)
        if empty.any() and self.eos_token_id is not None:
            word, bit = divmod(self.eos_token_id, 32)
            bitmask[empty, word] = np.array([1 << bit], dtype=np.uint32).view(np.int32)[0]
        sched.grammar_bitmask = GrammarBitmask([sr.request_id for sr in rows], bitmask)
        self.stats.num_masked_rows += len(rows)
        self.stats.mask_seconds += time.perf_counter() - t0

    def update(self, changed: list[Request]) -> list[str]:
        """Feed the new output tokens of ``changed`` to their matchers. Returns the ids of
        unfinished requests whose grammar has ended (the caller finishes them: "stop")."""
        ended = []
        for req in changed:
            rid = req.request_id
            if rid not in self._specs or rid not in self._states:
                continue
            state = self._sync(rid, req.output_token_ids)
            if not req.is_finished and state.matcher.is_stopped():
                ended.append(rid)
        return ended

    def _sync(self, request_id: str, output_token_ids: list[int]) -> _SeqGrammar:
        """The sequence's matcher, advanced over every output token it has not consumed
        (rebuilt from all of them after a recompute preemption dropped it)."""
        state = self._states.get(request_id)
        if state is None:
            state = _SeqGrammar(self.compiler.compile(self._specs[request_id]))
            self._states[request_id] = state
            self.stats.num_rebuilt += 1
        matcher = state.matcher
        for token_id in output_token_ids[state.num_consumed :]:
            if matcher.is_error() or matcher.is_stopped():
                break
            if not matcher.consume_token(token_id):
                self.stats.num_rejected_tokens += 1
        state.num_consumed = len(output_token_ids)
        return state
