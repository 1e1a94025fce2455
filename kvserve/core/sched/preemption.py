"""The scheduler's preemption mechanics: which victim may go, and how its blocks are released.

The policy (``core/policy.py``) ranks requests; this module applies it:

- ``choose_victim``: the policy's pick among the running requests not yet scheduled in
  this step (the requester included). Requests already scheduled in this step are never
  victims: their new blocks may already sit in the prefix cache and must be written by this
  step's forward pass.
- ``release_victim``: the preemption modes (``SchedulerConfig.preemption_mode``).
  "recompute" frees the victim's blocks, discards its ``num_computed_tokens`` (those it
  computed itself, not its prefix-hit or forked ones, are counted as wasted); the scheduler
  puts it back in the waiting queue (status PREEMPTED, ahead of fresh requests of its
  priority); its output tokens are kept and recomputed with the prompt, and the prefix cache
  may restore most of its blocks. "swap" moves its blocks to the host tier (status SWAPPED);
  if the host tier is full it falls back to recompute.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import TYPE_CHECKING

from kvserve.core.sched.policy import PreemptionPolicy
from kvserve.core.sched.sched_stats import SchedulerStats
from kvserve.core.sched.step_plan import StepPlan
from kvserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvserve.core.kv.kv_cache_manager import KVCacheManager


def choose_victim(
    policy: PreemptionPolicy,
    request: Request,
    running: Sequence[Request],
    scheduled_ids: Container[str],
    kv: KVCacheManager,
) -> Request:
    """The victim to preempt so ``request`` can get a block (possibly ``request`` itself).

    RuntimeError if ``request`` runs alone (the pool cannot hold it); ValueError if the
    policy picks a request that is not a candidate.
    """
    candidates = [r for r in running if r.request_id not in scheduled_ids]
    if candidates == [request] and len(running) == 1:
        # NOTE: unreachable while update_from_output finishes requests whose next
        # token needs more blocks than the pool; guards against looping forever.
        raise RuntimeError(
            f"KV pool cannot hold request {request.request_id!r} alone "
            f"({kv.num_free_blocks} of {kv.num_blocks} blocks free)"
        )
    victim = policy.select_victim(candidates)
    if not any(victim is c for c in candidates):
        raise ValueError(f"policy chose {victim.request_id!r}, not one of the candidates")
    return victim


def release_victim(
    victim: Request, kv: KVCacheManager, *, swap: bool, totals: SchedulerStats, step: StepPlan
) -> None:
    """Swap ``victim`` out (``swap``, host room permitting) or free it for recompute.

    Sets its status (SWAPPED or PREEMPTED) and counts the preemption in ``totals`` and the
    step; the caller moves it to the swapped or waiting queue.
    """
    victim.num_preemptions += 1
    step.stats.num_preemptions += 1
    step.out.preempted_req_ids.add(victim.request_id)
    totals.preemptions += 1
    if swap:
        pairs = kv.swap_out(victim)
        if pairs is not None:
            step.out.blocks_to_swap_out.extend(pairs)
            victim.status = RequestStatus.SWAPPED
            totals.preemptions_swap += 1
            return
        totals.swap_fallbacks_to_recompute += 1
    totals.preemptions_recompute += 1
    # NOTE: only the tokens it computed itself: its prefix-hit (or forked) tokens cost no
    # compute, so dropping them wastes none.
    wasted = victim.num_computed_tokens - victim.num_reused_tokens
    totals.recomputed_tokens_wasted += wasted
    step.stats.num_recomputed_tokens += wasted
    kv.free(victim)
    victim.num_computed_tokens = victim.num_reused_tokens = 0
    victim.status = RequestStatus.PREEMPTED
