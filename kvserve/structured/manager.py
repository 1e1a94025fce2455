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

Fault isolation: an exception the grammar engine raises for one sequence (building its
mask, consuming its token, rebuilding its matcher), or a limit of the grammar engine its
matcher runs out of mid-generation (``limits.limit_error``), is that sequence's fault, as a
runner fault pinned on one request is: ``prepare`` and ``update`` catch it, drop that matcher
and report the request id with the reason; the engine fails that request alone (an error,
never "stop": its output does not follow the constraint to its end) and steps on. A limit's
reason is a ``limits.LimitFault``: that request finishes with finish reason "error" and keeps
its text so far.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvserve.core.outputs import GrammarBitmask, SchedulerOutput
from kvserve.request import Request, RequestStatus
from kvserve.structured.compiler import DEFAULT_CACHE_SIZE, GrammarCompiler
from kvserve.structured.limits import LimitFault, limit_error
from kvserve.structured.spec import StructuredOutputsParams

logger = logging.getLogger("kvserve.structured")


class _OverLimit(Exception):
    """A matcher ran out of a limit of the grammar engine (the message names it)."""


@dataclass(slots=True)
class _SeqGrammar:
    """A sequence's matcher and how many of its output tokens it has consumed."""

    matcher: Any  # llguidance.LLMatcher
    num_consumed: int = 0
    dead_logged: bool = False  # the "grammar allows no token" warning was logged


@dataclass(slots=True)
class StructuredStats:
    """Counters for tests and benchmarks."""

    num_rebuilt: int = 0  # matchers rebuilt after a recompute preemption
    num_forked: int = 0  # n > 1 samples given a copy of the first sample's matcher
    num_rejected_tokens: int = 0  # sampled tokens the grammar refused (should stay 0)
    num_faults: int = 0  # sequences failed by the grammar engine (it raised, or no token)
    num_masked_rows: int = 0
    mask_seconds: float = 0.0


class StructuredOutputManager:
    """Matchers and bitmasks for the constrained requests of one engine.

    Args:
        hf_tokenizer: the model's fast Hugging Face tokenizer.
        vocab_size: logits columns of the model.
        eos_token_id: the end token a finished grammar allows.
        cache_size: compiled constraints kept (GrammarCompiler).
        compact_json: JSON without whitespace between its tokens (GrammarCompiler).
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_id: int | None,
        cache_size: int = DEFAULT_CACHE_SIZE,
        *,
        compact_json: bool = False,
    ) -> None:
        self.compact_json = compact_json
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
                self._hf_tokenizer,
                self.vocab_size,
                self.eos_token_id,
                self.cache_size,
                compact_json=self.compact_json,
            )
        return self._compiler

    @property
    def num_matchers(self) -> int:
        """Matchers held now (running or swapped constrained sequences)."""
        return len(self._states)

    def has(self, request_id: str) -> bool:
        """Whether ``request_id`` has a structured-output constraint (a matcher to feed)."""
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

    def prepare(
        self, sched: SchedulerOutput, get_request: Callable[[str], Request | None]
    ) -> dict[str, str]:
        """Drop the matchers of requests this step preempted for recompute, then set
        ``sched.grammar_bitmask`` for the constrained requests that sample (None if none).

        Returns the requests the grammar engine failed (request id -> reason): it raised
        for them, their matcher ran out of a limit, or their grammar allows no token and
        there is no EOS to end them with.
        They get no bitmask row and their matchers are dropped; the caller fails them (the
        token the runner samples for them is never used).
        """
        faults: dict[str, str] = {}
        if not self._specs:
            return faults
        for rid in sched.preempted_req_ids:
            req = get_request(rid)
            if req is not None and req.status == RequestStatus.PREEMPTED:
                self._states.pop(rid, None)
        rows = [sr for sr in sched.scheduled if sr.sample and sr.request_id in self._specs]
        if not rows:
            return faults
        t0 = time.perf_counter()
        bitmask = np.zeros((len(rows), self._num_words), dtype=np.int32)  # [G, ceil(V/32)]
        for i, sr in enumerate(rows):
            try:
                self._fill_row(sr.request_id, sr.output_token_ids, bitmask[i])
            except _OverLimit as e:
                faults[sr.request_id] = self._fault(sr.request_id, LimitFault(str(e)))
            except Exception as e:  # noqa: BLE001 - this sequence's grammar only
                reason = f"structured output failed computing the mask: {e!r}"
                faults[sr.request_id] = self._fault(sr.request_id, reason)
        # NOTE: a matcher in an error state, stopped, or with nothing allowed gets EOS only:
        # the request ends instead of sampling from an empty distribution (as vLLM does).
        empty = ~bitmask.any(axis=1)
        if empty.any() and self.eos_token_id is not None:
            word, bit = divmod(self.eos_token_id, 32)
            bitmask[empty, word] = np.array([1 << bit], dtype=np.uint32).view(np.int32)[0]
        elif empty.any():
            for i in np.flatnonzero(empty):
                rid = rows[i].request_id
                if rid not in faults:
                    reason = "structured output: the grammar allows no next token (and no EOS)"
                    faults[rid] = self._fault(rid, reason)
        keep = [i for i, sr in enumerate(rows) if sr.request_id not in faults]
        if keep:
            # NOTE: a failed request's row is left out: its token is sampled unconstrained
            # (never from an empty row) and then ignored.
            ids = [rows[i].request_id for i in keep]
            sched.grammar_bitmask = GrammarBitmask(ids, bitmask[keep] if faults else bitmask)
        self.stats.num_masked_rows += len(keep)
        self.stats.mask_seconds += time.perf_counter() - t0
        return faults

    def update(self, changed: list[Request]) -> tuple[list[str], dict[str, str]]:
        """Feed the new output tokens of ``changed`` to their matchers.

        Returns the ids of unfinished requests whose grammar has ended (the caller finishes
        them: "stop") and the requests the grammar engine raised for (request id -> reason;
        their matchers are dropped, the caller fails them).
        """
        ended: list[str] = []
        faults: dict[str, str] = {}
        for req in changed:
            rid = req.request_id
            if rid not in self._specs or rid not in self._states:
                continue
            try:
                state = self._sync(rid, req.output_token_ids)
                stopped = state.matcher.is_stopped()
                over_limit = limit_error(state.matcher)
            except Exception as e:  # noqa: BLE001 - this sequence's grammar only
                reason = f"structured output failed consuming the sampled token: {e!r}"
                faults[rid] = self._fault(rid, reason)
                continue
            if over_limit is not None:
                faults[rid] = self._fault(rid, LimitFault(f"structured output: {over_limit}"))
                continue
            if not req.is_finished and stopped:
                ended.append(rid)
        return ended, faults

    def _fill_row(self, request_id: str, output_token_ids: list[int], row: np.ndarray) -> None:
        """Write the sequence's allowed next tokens into ``row`` (left all zero when its
        matcher is stopped or in an error state)."""
        state = self._sync(request_id, output_token_ids)
        matcher = state.matcher
        if not (matcher.is_error() or matcher.is_stopped()):
            matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        over_limit = limit_error(matcher)
        if over_limit is not None:
            raise _OverLimit(f"structured output: {over_limit}")
        if matcher.is_error() and not state.dead_logged:
            # NOTE: a grammar that dead-ends (no token can extend the output) ends the request
            # with EOS and finish reason "stop", as vLLM does; the warning says why it ended.
            state.dead_logged = True
            reason = (matcher.get_error().strip().splitlines() or ["(no message)"])[0]
            logger.warning(
                "request %s: its grammar allows no next token (%s): it ends with EOS",
                request_id,
                reason,
            )

    def _fault(self, request_id: str, reason: str) -> str:
        """Drop the matcher of a sequence the grammar engine failed; returns ``reason``."""
        logger.warning("request %s: %s", request_id, reason)
        self._states.pop(request_id, None)
        self.stats.num_faults += 1
        return reason

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
