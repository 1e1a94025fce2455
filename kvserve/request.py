"""The engine's record of one sequence: tokens, progress counter, status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Life cycle: WAITING -> RUNNING <-> (PREEMPTED | SWAPPED) -> FINISHED_*."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # preempted by recompute: back in the waiting queue, blocks freed
    SWAPPED = 3  # preempted by swap: blocks live in the host tier
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_IGNORED = 13  # rejected: can never fit

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
}


@dataclass(slots=True, eq=False)
class Request:
    """One sequence. ``num_computed_tokens`` chases ``num_tokens`` (prompt + output).

    For ``n > 1`` the engine creates one Request per sample; samples 1..n-1 carry
    ``parent_id`` and wait in the parent's ``pending_children`` until the parent's prompt
    is computed, then fork its blocks (see Scheduler).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    parent_id: str | None = None  # set on samples 1..n-1 of an n > 1 request
    sample_index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Async scheduling (``SchedulerConfig.async_scheduling``): tokens a scheduled step will
    # sample that are not known yet. The scheduler counts them in ``num_computed_tokens``'s
    # target (one token each, as vLLM's ``num_output_placeholders``); they are not in
    # ``output_token_ids`` (nor in ``num_tokens``) until ``update_from_output`` brings them.
    num_output_placeholders: int = 0
    # Of num_computed_tokens, those it got without computing them since it was last admitted:
    # a prefix-cache hit (device or host tier), or the prompt a forked sample shares with its
    # parent. A recompute preemption counts only the rest as wasted work.
    num_reused_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_cached_tokens: int = (
        -1
    )  # prompt tokens served from the prefix cache (-1: not yet looked up)
    num_preemptions: int = 0
    pending_children: list[Request] = field(default_factory=list)
    # When a sample beyond its request's seat share joined the waiting queue (its queue
    # position); None: queued at arrival_time.
    requeue_time: float | None = None
    # Speculative decoding (core/sched/speculate.py): decayed counts of draft tokens accepted
    # and of draft tokens tested (accepted + the first rejected one) in its verifications.
    spec_accepted: float = 0.0
    spec_tested: float = 0.0
    # Timestamps (time.monotonic) for latency figures.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens: the length the KV cache must eventually cover."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt+output without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
