"""Token-budget continuous batching with chunked prefill, preemption and admission control.

One progress counter per request: ``num_computed_tokens`` chases ``num_tokens`` (prompt +
output). Each ``schedule()`` call hands out at most ``max_num_batched_tokens`` tokens, in
this order:

1. Running requests that are decoding (exactly one token left to compute), most important
   first (``PreemptionPolicy.sort_key``). If one cannot get a block, the policy picks a
   victim among the running requests not yet scheduled in this step (the requester
   included) and preempts it, until the block can be had or the requester itself was
   preempted. Requests already scheduled in this step are never victims: their new blocks
   may already sit in the prefix cache and must be written by this step's forward pass.
2. Running requests still prefilling (prompt, or prompt + output after a recompute
   preemption), in chunks of the remaining budget; same preemption rule.
3. Swapped-out requests are swapped back in (most important first), then
4. waiting requests are admitted in (priority, preempted-first, arrival) order, head of line
   only: if the head cannot be admitted, nobody behind it is. No admission while any
   request is swapped out. Steps 3 and 4 are skipped in a step that preempted.

With a step-time budget (``step_budget``, a ``core.step_budget.StepTimeBudget``; the engine
sets one by default), steps 2-4 also respect per-request prefill chunk caps that it plans right
after step 1, so the step's predicted time stays within its target (decodes are never capped;
a step without decodes is not capped; see that module). ``observe_step`` feeds it the engine's
step records.

Admission rules (steps 3 and 4):

- Seats: running requests plus their unforked n > 1 children stay within ``max_num_seqs``.
- Headroom: a request is admitted only if the blocks of all its known tokens (after
  prefix-cache hits) fit while ``ceil(admission_headroom * num_blocks)`` blocks stay free.
  Only the first chunk is allocated now; the rest of the prompt is held back as
  ``reserve`` in ``KVCacheManager.allocate_slots``.
- Hysteresis: a preemption closes admission; it reopens once ``num_free_blocks`` reaches
  ``ceil(resume_watermark * num_blocks)``, so the engine does not thrash between admitting
  and evicting.
- No deadlock: when nothing is running, the head is admitted (or swapped in) if it fits in
  the pool at all, regardless of headroom and hysteresis.

Preemption modes (``SchedulerConfig.preemption_mode``): "recompute" frees the victim's blocks,
discards its ``num_computed_tokens`` (counted as wasted) and puts it back in the waiting queue
(status PREEMPTED, ahead of fresh requests of its priority); its output tokens are kept and
recomputed with the prompt, and the prefix cache may restore most of its blocks. "swap" moves
its blocks to the host tier (status SWAPPED); if the host tier is full it falls back to
recompute.

``update_from_output`` advances the counters, forks pending n > 1 children once the parent's
prompt is computed, appends sampled tokens, applies stop checks and frees finished requests'
blocks in the same step, so new requests can use them in the very next step.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.config import SchedulerConfig
from kvserve.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from kvserve.core.policy import PreemptionPolicy, PriorityPolicy
from kvserve.core.sched_stats import SchedulerStats, StepStats
from kvserve.core.step_budget import PrefillCandidate, StepTimeBudget
from kvserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvserve.core.kv_cache_manager import KVCacheManager


@dataclass(slots=True)
class _Step:
    """Mutable state of one ``schedule()`` call."""

    out: SchedulerOutput
    stats: StepStats
    budget: int
    scheduled_ids: set[str] = field(default_factory=set)
    prefill_caps: dict[str, int] | None = None  # step-time budget: tokens per request id


def _fraction_to_blocks(fraction: float, num_blocks: int) -> int:
    # NOTE: the epsilon keeps e.g. 0.1 * 30 = 3.0000000000000004 from rounding up to 4.
    return math.ceil(fraction * num_blocks - 1e-9)


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
    ) -> None:
        self.config = config
        self.step_budget = step_budget  # None: the token budget alone sizes prefill chunks
        self.kv = kv_cache_manager
        self.policy = policy if policy is not None else PriorityPolicy()
        self.clock = clock
        self.requests: dict[str, Request] = {}  # every unfinished request, pending children too
        self.waiting: list[Request] = []  # sorted by _waiting_key
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.totals = SchedulerStats()
        self.last_step = StepStats()
        self.headroom_blocks = _fraction_to_blocks(
            config.admission_headroom, kv_cache_manager.num_blocks
        )
        self.resume_blocks = _fraction_to_blocks(
            config.resume_watermark, kv_cache_manager.num_blocks
        )
        self.admission_closed = False  # set by a preemption, cleared at the resume watermark
        self._finished_ids: set[str] = set()  # finished since the last schedule()

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a new request (with its n > 1 samples in ``request.pending_children``).

        Raises ValueError naming the limit if it can never run: empty prompt, prompt +
        max_tokens beyond max_model_len (with max_tokens None: a prompt that leaves no room
        for one token), more blocks than the whole pool, more samples than max_num_seqs, or
        (chunked prefill disabled) a prompt beyond max_num_batched_tokens. Nothing changes on
        error.
        """
        self._validate(request)
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
        """Seats of max_num_seqs no running request holds or has reserved for its samples."""
        return max(0, self.config.max_num_seqs - self._num_seats())

    def stats(self) -> dict[str, float | int]:
        """The KV snapshot plus scheduler figures, by the names in DESIGN.md."""
        d: dict[str, float | int] = dict(self.kv.snapshot())
        d.update(self.totals.as_dict())
        d.update(num_running=self.num_running, num_waiting=self.num_waiting)
        d.update(num_swapped=self.num_swapped, admission_closed=int(self.admission_closed))
        if self.step_budget is not None:
            d.update(self.step_budget.stats())
        return d

    def observe_step(self, record: dict[str, float]) -> None:
        """Feed one executed step's record (``LLMEngine.step_records``) to the step budget."""
        if self.step_budget is not None:
            self.step_budget.observe(record)

    def _validate(self, request: Request) -> None:
        cfg, kv = self.config, self.kv
        rid = request.request_id
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {rid!r} must be new (WAITING, nothing computed)")
        for r in (request, *request.pending_children):
            if r.request_id in self.requests:
                raise ValueError(f"request id {r.request_id!r} is already in use")
        for child in request.pending_children:
            if child.parent_id != rid or child.prompt_token_ids != request.prompt_token_ids:
                raise ValueError(f"pending child {child.request_id!r} must share parent {rid!r}")
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if 1 + len(request.pending_children) > cfg.max_num_seqs:
            raise ValueError(
                f"request {rid!r} has more samples than max_num_seqs={cfg.max_num_seqs}"
            )
        max_tokens = request.max_tokens
        need = num_prompt + (max_tokens if max_tokens is not None else 1)
        if need > cfg.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt ({num_prompt}) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len={cfg.max_model_len}"
            )
        num_tokens = num_prompt + max_tokens if max_tokens is not None else num_prompt
        if kv.num_blocks_for(num_tokens) > kv.num_blocks:
            raise ValueError(
                f"request {rid!r} needs {kv.num_blocks_for(num_tokens)} KV blocks for "
                f"{num_tokens} tokens, more than the whole pool (num_kv_blocks={kv.num_blocks})"
            )
        if not cfg.enable_chunked_prefill and num_prompt > cfg.max_num_batched_tokens:
            raise ValueError(
                f"request {rid!r}: prompt ({num_prompt}) exceeds max_num_batched_tokens="
                f"{cfg.max_num_batched_tokens} and chunked prefill is disabled"
            )

    def _waiting_key(self, request: Request) -> tuple:
        # Recompute-preempted requests go ahead of fresh ones of the same priority.
        preempted_first = 0 if request.status == RequestStatus.PREEMPTED else 1
        queued_at = request.arrival_time if request.requeue_time is None else request.requeue_time
        key = (request.priority, preempted_first, queued_at, request.sample_index)
        return (*key, request.request_id)

    def _enqueue_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self._waiting_key)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """Plan one step (see the module docstring for the order and admission rules).

        For every ScheduledRequest, ``start_pos == request.num_computed_tokens`` and
        ``sample`` is True exactly when ``start_pos + len(token_ids) == request.num_tokens``.
        ``update_from_output`` must be called with the result before the next schedule().
        """
        t0 = time.perf_counter()
        step = _Step(
            out=SchedulerOutput(finished_req_ids=self._finished_ids),
            stats=StepStats(step=self.totals.num_steps),
            budget=self.config.max_num_batched_tokens,
        )
        self._finished_ids = set()
        self.running.sort(key=self.policy.sort_key)
        if self.config.scheduling_policy == "priority":
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
        # Host prefix tier: evicted cached blocks copied out, host hits loaded back.
        offloads, loads = self.kv.take_pending_swaps()
        step.out.blocks_to_swap_out.extend(offloads)
        step.out.blocks_to_swap_in.extend(loads)
        self._record_step(step, time.perf_counter() - t0)
        return step.out

    def _schedule_running(self, step: _Step, *, decodes: bool) -> None:
        """Give running decodes (or unfinished prefills) their tokens, preempting if needed."""
        for request in list(self.running):
            if step.budget == 0:
                return
            if request.status != RequestStatus.RUNNING or request.request_id in step.scheduled_ids:
                continue  # preempted or finished earlier in this step
            remaining = request.num_tokens - request.num_computed_tokens
            if (remaining == 1) != decodes:
                continue
            num_new = self._chunk_size(remaining, self._prefill_budget(request, remaining, step))
            if num_new and self._allocate_or_preempt(request, num_new, step):
                self._emit(request, num_new, step)

    def _chunk_size(self, remaining: int, budget: int) -> int:
        """Tokens to schedule now out of ``remaining``: all, a budget-sized chunk, or none."""
        if remaining <= budget:
            return remaining
        # NOTE: without chunked prefill a fresh prompt never exceeds the budget (add_request),
        # but prompt + output after a recompute preemption can; it is chunked anyway.
        if self.config.enable_chunked_prefill or remaining > self.config.max_num_batched_tokens:
            return budget
        return 0

    def _prefill_budget(self, request: Request, remaining: int, step: _Step) -> int:
        """The step's token budget, cut to the step-time budget's cap for a prefill chunk."""
        caps = step.prefill_caps
        if caps is None or remaining == 1:
            return step.budget
        if request.request_id not in caps:
            # NOTE: a waiting request left out of the plan (admission reopened in this step)
            # waits one step; anything else unplanned is never held back.
            waiting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            return 0 if waiting else step.budget
        return min(step.budget, caps[request.request_id])

    def _plan_prefill(self, step: _Step) -> dict[str, int] | None:
        """Ask the step-time budget for prefill chunk caps once this step's decodes are in.

        Candidates in FCFS order: running prefills, swapped requests, then the waiting queue
        while seats last (no waiting ones while admission is closed or any is swapped).
        """
        if self.step_budget is None or not self.config.enable_chunked_prefill:
            return None
        decode_contexts = [sr.start_pos + 1 for sr in step.out.scheduled]
        now = self.clock()
        candidates = []
        for r in (*self.running, *self.swapped):
            remaining = r.num_tokens - r.num_computed_tokens
            if remaining > 1 and r.request_id not in step.scheduled_ids:
                wait = 0.0 if r.output_token_ids else now - r.arrival_time  # TTFT aging
                candidates.append(
                    PrefillCandidate(r.request_id, r.num_computed_tokens, remaining, waited_s=wait)
                )
        seats = self.config.max_num_seqs - self._num_seats()
        if not self.swapped and (not self.running or not self.admission_closed):
            for r in self.waiting:
                seats -= 1 + len(r.pending_children)
                if seats < 0:
                    break
                wait = 0.0 if r.output_token_ids else now - r.arrival_time
                candidates.append(PrefillCandidate(r.request_id, 0, r.num_tokens, True, wait))
        return self.step_budget.plan(decode_contexts, candidates, step.budget)

    def _allocate_or_preempt(self, request: Request, num_new: int, step: _Step) -> bool:
        """Allocate slots for ``num_new`` tokens, preempting victims until it works.

        Returns False if ``request`` itself was chosen as the victim.
        """
        while self.kv.allocate_slots(request, num_new) is None:
            candidates = [r for r in self.running if r.request_id not in step.scheduled_ids]
            if candidates == [request] and len(self.running) == 1:
                # NOTE: unreachable while update_from_output finishes requests whose next
                # token needs more blocks than the pool; guards against looping forever.
                raise RuntimeError(
                    f"KV pool cannot hold request {request.request_id!r} alone "
                    f"({self.kv.num_free_blocks} of {self.kv.num_blocks} blocks free)"
                )
            victim = self.policy.select_victim(candidates)
            if not any(victim is c for c in candidates):
                raise ValueError(f"policy chose {victim.request_id!r}, not one of the candidates")
            self._preempt(victim, step)
            if victim is request:
                return False
        return True

    def _preempt(self, victim: Request, step: _Step, *, recompute: bool = False) -> None:
        """Swap ``victim`` out (swap mode, host room permitting) or free it for recompute."""
        self.running.remove(victim)
        victim.num_preemptions += 1
        self.admission_closed = True
        step.stats.num_preemptions += 1
        step.out.preempted_req_ids.add(victim.request_id)
        totals = self.totals
        totals.preemptions += 1
        if self.config.preemption_mode == "swap" and not recompute:
            pairs = self.kv.swap_out(victim)
            if pairs is not None:
                step.out.blocks_to_swap_out.extend(pairs)
                victim.status = RequestStatus.SWAPPED
                self.swapped.append(victim)
                totals.preemptions_swap += 1
                return
            totals.swap_fallbacks_to_recompute += 1
        totals.preemptions_recompute += 1
        totals.recomputed_tokens_wasted += victim.num_computed_tokens
        step.stats.num_recomputed_tokens += victim.num_computed_tokens
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        self._enqueue_waiting(victim)

    def _num_seats(self) -> int:
        """Running requests plus the unforked children they reserved (max_num_seqs)."""
        return len(self.running) + sum(self._reserved_children(r) for r in self.running)

    def _reserved_children(self, request: Request) -> int:
        """Unforked children that fork with the parent: up to its share of the seats."""
        return min(len(request.pending_children), self.config.seat_share - 1)

    def _has_seat(self, request: Request) -> bool:
        need = 1 + self._reserved_children(request)
        return self._num_seats() + need <= self.config.max_num_seqs

    def _preempt_for_priority(self, step: _Step) -> None:
        """Priority policy: preempt running requests less important than the waiting head
        (larger ``priority`` value) while the head lacks a seat or blocks. By recompute, and
        without closing admission: the head is admitted in a following step (this step
        admits nobody, as after any preemption)."""
        while self.waiting:
            head = self.waiting[0]
            blocks = self.kv.num_blocks_for(head.num_tokens) + self.headroom_blocks
            if self._has_seat(head) and self.kv.num_free_blocks >= blocks:
                return
            victims = [r for r in self.running if r.priority > head.priority]
            if not victims:
                return
            was_closed = self.admission_closed
            self._preempt(self.policy.select_victim(victims), step, recompute=True)
            self.totals.priority_preemptions += 1
            self.admission_closed = was_closed

    def _admission_open(self) -> bool:
        """Hysteresis: closed by a preemption until the free blocks reach the watermark."""
        if self.admission_closed and self.kv.num_free_blocks >= self.resume_blocks:
            self.admission_closed = False
        return not self.admission_closed

    def _schedule_swap_ins(self, step: _Step) -> None:
        """Bring swapped-out requests back, most important first, before any admission."""
        self.swapped.sort(key=self.policy.sort_key)
        while self.swapped and step.budget > 0:
            request = self.swapped[0]
            alone = not self.running  # deadlock guard: ignore headroom and hysteresis
            if not (alone or self._admission_open()) or not self._has_seat(request):
                return
            pairs = self.kv.swap_in(request, reserve=0 if alone else self.headroom_blocks)
            if pairs is None:
                return
            step.out.blocks_to_swap_in.extend(pairs)
            self.swapped.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = self._chunk_size(remaining, self._prefill_budget(request, remaining, step))
            # NOTE: if its next block cannot be had it stays running, unscheduled, this step.
            if num_new and self.kv.allocate_slots(request, num_new) is not None:
                self._emit(request, num_new, step)

    def _schedule_admissions(self, step: _Step) -> None:
        """Admit waiting requests in queue order while budget, seats and blocks allow."""
        while self.waiting and step.budget > 0 and not self.swapped:
            request = self.waiting[0]
            alone = not self.running  # deadlock guard: ignore headroom and hysteresis
            if not (alone or self._admission_open()) or not self._has_seat(request):
                return
            if not self._admit(request, step, alone=alone):
                return

    def _admit(self, request: Request, step: _Step, *, alone: bool) -> bool:
        """Allocate the first chunk of the queue head (after prefix hits) and schedule it."""
        computed_block_ids, num_hit = self.kv.get_computed_blocks(request)
        if request.sampling_params.prompt_logprobs is not None:
            # NOTE: prompt logprobs come from the prefill's hidden states; cached positions
            # have none, so such a request computes its whole prompt (it still fills the cache).
            computed_block_ids, num_hit = [], 0
        remaining = request.num_tokens - num_hit
        num_new = self._chunk_size(remaining, self._prefill_budget(request, remaining, step))
        if num_new == 0:
            return False
        reserve = 0
        if not alone:
            # Blocks for the rest of the known tokens stay free too, plus the headroom.
            rest = self.kv.num_blocks_for(request.num_tokens)
            rest -= self.kv.num_blocks_for(num_hit + num_new)
            reserve = self.headroom_blocks + rest
        new_block_ids = self.kv.allocate_slots(
            request, num_new, computed_block_ids, num_hit, reserve=reserve
        )
        if new_block_ids is None:
            return False
        self.waiting.pop(0)
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = min(num_hit, request.num_prompt_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._emit(request, num_new, step)
        return True

    def _emit(self, request: Request, num_new: int, step: _Step) -> None:
        """Append the ScheduledRequest for ``num_new`` tokens from num_computed_tokens on."""
        start = request.num_computed_tokens
        end = start + num_new
        params = request.sampling_params
        step.out.scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                token_ids=request.token_ids_slice(start, end),
                start_pos=start,
                block_ids=list(self.kv.get_block_ids(request.request_id)),
                sample=end == request.num_tokens,
                sampling_params=params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
                seed=None if params.seed is None else params.seed + request.sample_index,
            )
        )
        step.scheduled_ids.add(request.request_id)
        step.budget -= num_new
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()

    def _record_step(self, step: _Step, elapsed_s: float) -> None:
        s = step.stats
        s.num_running, s.num_waiting, s.num_swapped = (
            self.num_running,
            self.num_waiting,
            self.num_swapped,
        )
        s.num_scheduled_requests = len(step.out.scheduled)
        s.num_scheduled_tokens = step.out.total_num_scheduled_tokens
        s.num_free_blocks, s.kv_usage = self.kv.num_free_blocks, self.kv.usage
        s.schedule_time_s = elapsed_s
        self.totals.record_step(s)
        self.last_step = s

    # ------------------------------------------------------------------ update

    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[Request]:
        """Apply one executed step: advance counters, fork children, append tokens, stop.

        A scheduled request that was finished (or aborted) between schedule() and now is
        skipped, its sampled token ignored. Returns the requests that got a token or
        finished in this step, in scheduling order.
        """
        touched: list[Request] = []
        for sr in sched.scheduled:
            request = self.requests.get(sr.request_id)
            if (
                request is None
                or request.status != RequestStatus.RUNNING
                or request.num_computed_tokens != sr.start_pos
            ):
                continue
            request.num_computed_tokens += sr.num_tokens
            if (
                request.pending_children
                and request.num_computed_tokens >= request.num_prompt_tokens
            ):
                self._fork_children(request)
            if not sr.sample:
                continue
            token_id = out.sampled_token_ids.get(sr.request_id)
            if token_id is None:
                raise ValueError(f"ModelRunnerOutput lacks the sampled token of {sr.request_id!r}")
            self._append_token(request, token_id)
            touched.append(request)
        return touched

    def _fork_children(self, parent: Request) -> None:
        """Fork the parent's prompt blocks into its pending n > 1 children (now RUNNING).

        Each child recomputes the last prompt token (writing into the shared last block
        triggers copy-on-write) and so samples its own first token.
        """
        children = parent.pending_children
        num_fork = len(children)
        if self.waiting:
            # NOTE: others wait: only the parent's share of the seats forks now; the other
            # samples join the queue behind them (a prefix-cache hit restores the prompt).
            num_fork = self._reserved_children(parent)
        else:  # nobody waits: every sample that finds a free seat
            reserved = self._reserved_children(parent)
            seats_of_others = self._num_seats() - reserved  # the parent's own seat included
            num_fork = max(reserved, min(num_fork, self.config.max_num_seqs - seats_of_others))
        now = self.clock()
        for child in children[num_fork:]:
            child.requeue_time = now
            self._enqueue_waiting(child)
        for child in children[:num_fork]:
            self.kv.fork(parent, child)
            child.num_computed_tokens = parent.num_prompt_tokens - 1
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        parent.pending_children = []

    def _append_token(self, request: Request, token_id: int) -> None:
        now = self.clock()
        request.output_token_ids.append(token_id)
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        status = self._check_stop(request, token_id)
        if status is not None:
            self._finish(request, status)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        """Stop checks after appending ``token_id``; sets ``stop_reason`` for stop tokens.

        EOS (unless ignore_eos) and stop_token_ids count only once min_tokens tokens exist;
        then max_tokens, max_model_len, and a next token whose KV would need more blocks
        than the whole pool (a request growing without max_tokens) finish with "length".
        """
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id == request.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if self.kv.num_blocks_for(request.num_tokens) > self.kv.num_blocks:
            return RequestStatus.FINISHED_LENGTH
        return None

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
