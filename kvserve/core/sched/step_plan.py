"""One ``Scheduler.schedule()`` call's plan: its token budget, chunk sizes and output.

``StepPlan`` is the mutable state of one step: the ``SchedulerOutput`` being built, the
step's ``StepStats``, the token budget left (``max_num_batched_tokens`` at the start) and,
with a step-time budget, its per-request prefill chunk caps. ``chunk`` sizes a request's
next chunk under both budgets and the chunked-prefill setting; ``emit`` appends the
``ScheduledRequest`` and charges the budget; ``record`` fills the step's figures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.core.outputs import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from kvserve.core.sched.sched_stats import StepStats
from kvserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvserve.core.kv.kv_cache_manager import KVCacheManager


@dataclass(slots=True)
class StepPlan:
    """Mutable state of one ``schedule()`` call."""

    out: SchedulerOutput
    stats: StepStats
    budget: int  # tokens left to hand out in this step
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    scheduled_ids: set[str] = field(default_factory=set)
    prefill_caps: dict[str, int] | None = None  # step-time budget: tokens per request id

    def prefill_budget(self, request: Request, remaining: int) -> int:
        """The step's token budget, cut to the step-time budget's cap for a prefill chunk."""
        caps = self.prefill_caps
        if caps is None or remaining == 1:
            return self.budget
        if request.request_id not in caps:
            # NOTE: a waiting request left out of the plan (admission reopened in this step)
            # waits one step; anything else unplanned is never held back.
            waiting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            return 0 if waiting else self.budget
        return min(self.budget, caps[request.request_id])

    def chunk(self, request: Request, remaining: int) -> int:
        """Tokens to schedule now out of ``remaining``: all, a budget-sized chunk, or none."""
        budget = self.prefill_budget(request, remaining)
        if remaining <= budget:
            return remaining
        # NOTE: without chunked prefill a fresh prompt never exceeds the budget (add_request),
        # but prompt + output after a recompute preemption can; it is chunked anyway.
        if self.enable_chunked_prefill or remaining > self.max_num_batched_tokens:
            return budget
        return 0

    def emit(
        self,
        request: Request,
        num_new: int,
        kv: KVCacheManager,
        clock: Callable[[], float],
        drafts: list[int] | None = None,
    ) -> None:
        """Append the ScheduledRequest for ``num_new`` tokens from num_computed_tokens on,
        reading the request's block table (every group's of a hybrid cache) from ``kv``;
        charge the budget. ``drafts`` (speculative decoding): the last ``len(drafts)`` of
        the ``num_new`` tokens."""
        drafts = drafts or []
        start = request.num_computed_tokens
        end = start + num_new - len(drafts)
        params = request.sampling_params
        token_ids = request.token_ids_slice(start, end)
        if end > request.num_tokens:
            # NOTE: async scheduling: the in-flight step samples this token (resolve_ahead).
            token_ids.extend([PLACEHOLDER_TOKEN_ID] * (end - max(start, request.num_tokens)))
        token_ids.extend(drafts)
        self.out.scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                token_ids=token_ids,
                start_pos=start,
                block_ids=kv.get_block_ids(request.request_id),
                sample=end == request.num_tokens + request.num_output_placeholders,
                sampling_params=params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
                seed=None if params.seed is None else params.seed + request.sample_index,
                group_block_ids=kv.get_group_block_ids(request.request_id),
                spec_token_ids=drafts,
            )
        )
        self.scheduled_ids.add(request.request_id)
        self.budget -= num_new
        if request.first_scheduled_time is None:
            request.first_scheduled_time = clock()

    def record(
        self, queues: tuple[int, int, int], kv: KVCacheManager, elapsed_s: float
    ) -> StepStats:
        """Fill and return the step's figures: ``queues`` = (running, waiting, swapped)."""
        s = self.stats
        s.num_running, s.num_waiting, s.num_swapped = queues
        s.num_scheduled_requests = len(self.out.scheduled)
        s.num_scheduled_tokens = self.out.total_num_scheduled_tokens
        s.num_free_blocks, s.kv_usage = kv.num_free_blocks, kv.usage
        s.schedule_time_s = elapsed_s
        return s
