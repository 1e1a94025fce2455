"""Token-budget continuous batching with chunked prefill, preemption and admission control.

One progress counter per request: ``num_computed_tokens`` chases ``num_tokens`` (prompt +
output). Each ``schedule()`` call hands out at most ``max_num_batched_tokens`` tokens, in
this order:

1. Running requests that are decoding (exactly one token left to compute), most important
   first (``PreemptionPolicy.sort_key``). If one cannot get a block, the policy picks a
   victim among the running requests not yet scheduled in this step (the requester
   included) and preempts it, until the block can be had or the requester itself was
   preempted (``preemption.py``: never a request already scheduled in this step).
2. Running requests still prefilling (prompt, or prompt + output after a recompute
   preemption), in chunks of the remaining budget; same preemption rule.
3. Swapped-out requests are swapped back in (most important first), then
4. waiting requests are admitted in (priority, preempted-first, arrival) order, head of line
   only: if the head cannot be admitted, nobody behind it is. No admission while any
   request is swapped out. Steps 3 and 4 are skipped in a step that preempted.

Steps 2-4 respect per-request prefill chunk caps planned after step 1: a step-time budget's
(``step_budget``, fed by ``observe_step``), else the fair prefill share's (``fair_prefill``).
Rules: ``admission.py`` (seats, headroom, hysteresis, no deadlock: steps 3 and 4),
``preemption.py``, ``stop_checks``, ``speculate`` (drafts), ``step_plan``; this file the order.

``update_from_output`` advances the counters, forks pending n > 1 children once the parent's
prompt is computed, appends sampled tokens, applies stop checks and frees finished requests'
blocks in the same step, so new requests can use them in the very next step. Async
scheduling (vLLM's): the next schedule() may come before the step's tokens (``ahead.py``).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvserve.config import SchedulerConfig
from kvserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.core.sched import ahead
from kvserve.core.sched.admission import AdmissionControl, validate_request, waiting_key
from kvserve.core.sched.fair_prefill import plan_fair_prefill
from kvserve.core.sched.policy import PreemptionPolicy, PriorityPolicy
from kvserve.core.sched.preemption import choose_victim, release_victim
from kvserve.core.sched.sched_stats import SchedulerStats, StepStats
from kvserve.core.sched.speculate import Speculator
from kvserve.core.sched.step_budget import StepTimeBudget, prefill_candidates
from kvserve.core.sched.step_plan import StepPlan
from kvserve.core.sched.stop_checks import append_token, check_stop
from kvserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvserve.core.kv.kv_cache_manager import KVCacheManager


class Scheduler:
    """Decides, step by step, which tokens of which requests the model runner computes."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        *,
        policy: PreemptionPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        step_budget: StepTimeBudget | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        self.config, self.spec = config, speculator  # spec: None without speculative decoding
        self.step_budget = step_budget  # None: the token budget alone sizes prefill chunks
        self.kv = kv_cache_manager
        self.policy = policy if policy is not None else PriorityPolicy()
        self.clock = clock
        self.requests: dict[str, Request] = {}  # every unfinished request, pending children too
        self.waiting: list[Request] = []  # sorted by admission.waiting_key
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.totals = SchedulerStats()
        self.last_step = StepStats()
        self.admission = AdmissionControl(config, kv_cache_manager.num_blocks)
        self._finished_ids: set[str] = set()  # finished since the last schedule()

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a new request (its n > 1 samples in ``request.pending_children``); ValueError,
        nothing changed, if it can never run (``admission.validate_request``'s list)."""
        validate_request(request, self.config, self.kv, self.requests)
        for r in (request, *request.pending_children):
            self.requests[r.request_id] = r
        self._enqueue_waiting(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests in any state (waiting, running, preempted, swapped, pending child).

        Frees everything they held; aborting a parent also aborts its unforked children.
        Unknown or already finished ids are ignored (an abort may race with a finish). If
        called between schedule() and update_from_output(), the runner must still execute
        that step (its blocks may already be in the prefix cache); the request's sampled
        token is then ignored.
        """
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a FINISHED_* status, got {status.name}")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)

    def has_unfinished_requests(self) -> bool:
        """True while any request (pending children included) is not finished."""
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self.requests.get(request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue (fresh and recompute-preempted; not pending children)."""
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def num_free_seats(self) -> int:
        """Seats (``max_running``) no running request holds or has reserved for its samples."""
        return max(0, self.config.max_running - self._num_seats())

    @property
    def admission_closed(self) -> bool:
        """True from a preemption until the free blocks reach the resume watermark."""
        return self.admission.closed

    def stats(self) -> dict[str, float | int]:
        """The KV snapshot plus scheduler figures, by the names in DESIGN.md."""
        d: dict[str, float | int] = dict(self.kv.snapshot())
        d.update(self.totals.as_dict())
        d.update(num_running=self.num_running, num_waiting=self.num_waiting)
        waits = self.admission.waits(self.kv.num_free_blocks)
        d.update(num_swapped=self.num_swapped, admission_closed=int(waits))
        if self.step_budget is not None:
            d.update(self.step_budget.stats())
        if self.spec is not None:
            d.update(self.spec.stats.as_dict())
        return d

    def observe_step(self, record: dict[str, float]) -> None:
        """Feed one step's record (``LLMEngine.step_records``) to the budget and speculator."""
        for sink in (self.step_budget, self.spec):
            if sink is not None:
                sink.observe(record)

    def _enqueue_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=waiting_key)

    def _num_seats(self) -> int:
        """Running requests plus the unforked children they reserved (of max_running)."""
        return self.admission.num_seats(self.running)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """Plan one step (see the module docstring for the order and admission rules).

        For every ScheduledRequest, ``start_pos == request.num_computed_tokens`` and
        ``sample`` is True exactly when ``start_pos + len(token_ids) == request.num_tokens``.
        ``update_from_output`` must be called with the result before the next schedule().
        Async scheduling: the step is committed before returning (``ahead.py``).
        """
        t0 = time.perf_counter()
        cfg = self.config
        step = StepPlan(
            out=SchedulerOutput(finished_req_ids=self._finished_ids),
            stats=StepStats(step=self.totals.num_steps),
            budget=cfg.max_num_batched_tokens,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
        )
        self._finished_ids = set()
        self.running.sort(key=self.policy.sort_key)
        if cfg.scheduling_policy == "priority":
            self._preempt_for_priority(step)
        self._schedule_running(step, decodes=True)
        step.prefill_caps = self._plan_prefill(step)
        self._schedule_running(step, decodes=False)
        if not step.stats.num_preemptions:
            self._schedule_swap_ins(step)
            self._schedule_admissions(step)
        # NOTE: after every allocation of the step, so no request can be handed a block
        # freed here before this step's forward pass has run (it reads it, masked).
        for request in self.running:
            if request.request_id in step.scheduled_ids:
                self.kv.remove_skipped_blocks(request)
        step.out.blocks_to_copy = self.kv.take_pending_copies()
        offloads, loads = self.kv.take_pending_swaps()  # host prefix tier: offloads and loads
        step.out.blocks_to_swap_out.extend(offloads)
        step.out.blocks_to_swap_in.extend(loads)
        queues = (self.num_running, self.num_waiting, self.num_swapped)
        if cfg.async_scheduling:
            ahead.commit_scheduled(self.requests, step.out)
        self.last_step = step.record(queues, self.kv, time.perf_counter() - t0)
        self.totals.record_step(self.last_step)
        return step.out

    def _schedule_running(self, step: StepPlan, *, decodes: bool) -> None:
        """Give running decodes (or unfinished prefills) their tokens, preempting if needed."""
        for request in list(self.running):
            if step.budget == 0:
                return
            if request.status != RequestStatus.RUNNING or request.request_id in step.scheduled_ids:
                continue  # preempted or finished earlier in this step
            remaining = ahead.remaining_tokens(request)
            if (remaining == 1) != decodes:
                continue
            if ahead.ends_with_placeholder(request, self.config.max_model_len, self.kv):
                continue  # async scheduling: its in-flight token ends it
            num_new = step.chunk(request, remaining)
            spec = self.spec if decodes and num_new else None
            drafts = spec.draft(request, self.kv, step.budget, len(self.running)) if spec else []
            if drafts or (num_new and self._allocate_or_preempt(request, num_new, step)):
                self._emit(request, num_new + len(drafts), step, drafts)

    def _plan_prefill(self, step: StepPlan) -> dict[str, int] | None:
        """Prefill chunk caps after the decodes: the step-time budget's, or the fair share's."""
        if not self.config.enable_chunked_prefill:
            return None
        admit = not self.swapped and (not self.running or not self.admission_closed)
        candidates = prefill_candidates(
            (*self.running, *self.swapped),
            self.waiting if admit else (),
            step.scheduled_ids,
            self.config.max_running - self._num_seats(),
            self.clock(),
        )
        if self.step_budget is not None:  # NOTE: no time caps this step: the fair share's
            contexts = [sr.start_pos + 1 for sr in step.out.scheduled]
            if (caps := self.step_budget.plan(contexts, candidates, step.budget)) is not None:
                return caps
        return plan_fair_prefill(self.config, candidates, self.requests, self.kv, step.budget)

    def _allocate_or_preempt(self, request: Request, num_new: int, step: StepPlan) -> bool:
        """Allocate ``num_new`` slots, preempting victims until it works; False if ``request``
        itself was chosen as the victim."""
        while self.kv.allocate_slots(request, num_new) is None:
            victim = choose_victim(self.policy, request, self.running, step.scheduled_ids, self.kv)
            self._preempt(victim, step)
            if victim is request:
                return False
        return True

    def _preempt(self, victim: Request, step: StepPlan, *, recompute: bool = False) -> None:
        """Swap ``victim`` out (swap mode, host room permitting) or free it for recompute."""
        self.running.remove(victim)
        self.admission.closed = True
        swap = self.config.preemption_mode == "swap" and not recompute
        release_victim(victim, self.kv, swap=swap, totals=self.totals, step=step)
        if victim.status == RequestStatus.SWAPPED:
            self.swapped.append(victim)
        else:
            self._enqueue_waiting(victim)

    def _preempt_for_priority(self, step: StepPlan) -> None:
        """Priority policy: preempt running requests less important than the waiting head
        (larger ``priority`` value) while the head lacks a seat or blocks. By recompute, and
        without closing admission: the head is admitted in a following step (this step
        admits nobody, as after any preemption)."""
        while self.waiting:
            head = self.waiting[0]
            room = self.kv.has_room_for(head, self.admission.headroom_blocks)
            if self.admission.has_seat(head, self.running) and room:
                return
            victims = [r for r in self.running if r.priority > head.priority]
            if not victims:
                return
            was_closed = self.admission.closed
            self._preempt(self.policy.select_victim(victims), step, recompute=True)
            self.totals.priority_preemptions += 1
            self.admission.closed = was_closed

    def _may_start(self, request: Request) -> bool:
        """Seat and gate for the next swap-in or admission (the ``alone`` guard included)."""
        if request.num_output_placeholders:
            return False  # async scheduling: its in-flight token first (ahead.py)
        alone = not self.running  # deadlock guard: ignore headroom and hysteresis
        gate_open = alone or self.admission.is_open(self.kv.num_free_blocks)
        return gate_open and self.admission.has_seat(request, self.running)

    def _schedule_swap_ins(self, step: StepPlan) -> None:
        """Bring swapped-out requests back, most important first, before any admission."""
        self.swapped.sort(key=self.policy.sort_key)
        while self.swapped and step.budget > 0:
            request = self.swapped[0]
            alone = not self.running
            if not self._may_start(request):
                return
            reserve = 0 if alone else self.admission.headroom_blocks
            pairs = self.kv.swap_in(request, reserve=reserve)
            if pairs is None:
                return
            step.out.blocks_to_swap_in.extend(pairs)
            self.swapped.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_new = step.chunk(request, request.num_tokens - request.num_computed_tokens)
            # NOTE: if its next block cannot be had it stays running, unscheduled, this step.
            if num_new and self.kv.allocate_slots(request, num_new) is not None:
                self._emit(request, num_new, step)

    def _swapped_ahead_of(self, request: Request) -> bool:
        """Whether a swapped-out request is swapped in before ``request``: any under fcfs,
        one at least as important under priority (NOTE: as if it awaited recompute)."""
        if self.config.scheduling_policy != "priority":
            return bool(self.swapped)
        return any(r.priority <= request.priority for r in self.swapped)

    def _schedule_admissions(self, step: StepPlan) -> None:
        """Admit waiting requests in queue order while budget, seats and blocks allow."""
        while self.waiting and step.budget > 0 and not self._swapped_ahead_of(self.waiting[0]):
            request = self.waiting[0]
            if not self._may_start(request):
                return
            if not self._admit(request, step, alone=not self.running):
                return

    def _admit(self, request: Request, step: StepPlan, *, alone: bool) -> bool:
        """Allocate the first chunk of the queue head (after prefix hits) and schedule it."""
        computed_block_ids, num_hit = self.kv.get_computed_blocks(request)
        if request.sampling_params.prompt_logprobs is not None:
            # NOTE: prompt logprobs come from the prefill's hidden states; cached positions
            # have none, so such a request computes its whole prompt (it still fills the cache).
            computed_block_ids, num_hit = [], 0
        num_new = step.chunk(request, request.num_tokens - num_hit)
        if num_new == 0:
            return False
        # Blocks for the rest of the known tokens stay free too, plus the headroom.
        reserve = 0 if alone else self.admission.reserve(self.kv, request, num_hit + num_new)
        new_block_ids = self.kv.allocate_slots(
            request, num_new, computed_block_ids, num_hit, reserve=reserve
        )
        if new_block_ids is None:
            return False
        self.waiting.pop(0)
        request.num_computed_tokens = request.num_reused_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = min(num_hit, request.num_prompt_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._emit(request, num_new, step)
        return True

    def _emit(
        self, request: Request, num_new: int, step: StepPlan, drafts: list[int] | None = None
    ) -> None:
        """Schedule ``num_new`` tokens of ``request`` (``drafts`` last) from num_computed on."""
        step.emit(request, num_new, self.kv, self.clock, drafts)

    # ------------------------------------------------------------------ update

    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[Request]:
        """Apply one executed step: advance counters, fork children, append tokens, stop.

        A scheduled request that was finished (or aborted) between schedule() and now is
        skipped, its sampled token ignored. Returns the requests that got a token or
        finished in this step, in scheduling order. Async scheduling: a placeholder becomes
        its token, for a request preempted or swapped out since too (``ahead.py``).
        """
        committed = self.config.async_scheduling
        touched: list[Request] = []
        for sr in sched.scheduled:
            request = self.requests.get(sr.request_id)
            if request is None:
                continue
            running = request.status == RequestStatus.RUNNING
            if not committed:
                if not running or request.num_computed_tokens != sr.start_pos:
                    continue
                request.num_computed_tokens += sr.num_tokens
            accepted = self.spec.verified(request, sr, out, self.kv) if sr.spec_token_ids else []
            done = request.num_computed_tokens >= request.num_prompt_tokens
            if request.pending_children and running and done:
                self._fork_children(request)
            if not sr.sample:
                continue
            token_id = out.sampled_token_ids.get(sr.request_id)
            if token_id is None:
                raise ValueError(f"ModelRunnerOutput lacks the sampled token of {sr.request_id!r}")
            if committed:
                ahead.take_sampled(request)
            self._append_tokens(request, (*accepted, token_id))
            touched.append(request)
        return touched

    def _fork_children(self, parent: Request) -> None:
        """Fork the parent's prompt blocks into its pending n > 1 children (now RUNNING).

        Each child recomputes the last prompt token (writing into the shared last block
        triggers copy-on-write) and so samples its own first token.
        """
        children = parent.pending_children
        num_fork = self.admission.num_to_fork(parent, self.running, others_wait=bool(self.waiting))
        now = self.clock()
        for child in children[num_fork:]:
            child.requeue_time = now
            self._enqueue_waiting(child)
        for child in children[:num_fork]:
            self.kv.fork(parent, child)
            child.num_computed_tokens = child.num_reused_tokens = parent.num_prompt_tokens - 1
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        parent.pending_children = []

    def _append_tokens(self, request: Request, token_ids: Iterable[int]) -> None:
        limit = self.config.max_model_len
        for token_id in token_ids:  # NOTE: accepted drafts first: a stop among them ends it
            append_token(request, token_id, self.clock())
            status = check_stop(request, token_id, max_model_len=limit, kv=self.kv)
            if status is not None:
                return self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished, take it out of whatever queue holds it and free its blocks."""
        prior = request.status
        if prior == RequestStatus.RUNNING:
            self.running.remove(request)
            self.kv.free(request)
        elif prior == RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self.kv.free(request)  # releases its host-tier blocks
        elif request in self.waiting:
            self.waiting.remove(request)
        else:  # an unforked n > 1 child waiting in its parent
            parent = self.requests.get(request.parent_id) if request.parent_id else None
            if parent is None or request not in parent.pending_children:
                raise RuntimeError(f"request {request.request_id!r} is in no queue")
            parent.pending_children.remove(request)
        for child in list(request.pending_children):
            self._finish(child, status)
        request.status = status
        request.finished_time = self.clock()
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)
        self.totals.num_finished_requests += 1
        self.totals.num_aborted_requests += status == RequestStatus.FINISHED_ABORTED
