"""Async scheduling: the scheduler's side of scheduling a step while the previous one runs.

As vLLM v1's ``async_scheduling`` (its ``AsyncScheduler``): with
``SchedulerConfig.async_scheduling`` on, ``schedule()`` ends by *committing* the step it
planned (``commit_scheduled``): every scheduled request's ``num_computed_tokens`` advances
by its scheduled tokens at once, and a request that samples gets one output placeholder
(``Request.num_output_placeholders``). The next ``schedule()`` may then run before that
step's sampled tokens are known: it assumes each sampling request gets exactly one token,
so a decode's input is ``PLACEHOLDER_TOKEN_ID``. When the sampled tokens arrive,
``update_from_output`` turns each placeholder into the real token (stop checks as usual),
and ``resolve_ahead`` fills the next step's placeholders in and drops the work of requests
that have finished meanwhile, before that step runs.

Rules that keep the outputs those of synchronous scheduling:

- At most one step is ahead: a ``schedule()`` runs with at most the latest step's tokens
  unknown, so a request holds at most one placeholder at a schedule (two between the
  schedule ahead and the previous step's update).
- Placeholder positions are never offered to the prefix cache (``allocate_slots`` caps
  caching at ``request.num_tokens``, the known tokens); a block becomes cacheable at the
  request's next allocation, once its token is known.
- A request with a placeholder is not admitted or swapped in (it can only be preempted in
  the step ahead, and a step that preempts admits nobody; guarded anyway).
- A preempted (or swapped-out) request still gets the token its in-flight step sampled, as
  it would have before the preemption in a synchronous run.
- A request whose in-flight token surely ends it (``max_tokens``, ``max_model_len``, the
  pool) is not scheduled ahead.
- A step in which a request forks its n > 1 samples is not scheduled ahead of
  (``can_schedule_ahead``): the forks take the parent's table as it is after that step.

The engine side (the forward on its own thread, structured output, faults) is in
``engine/llm_engine.py``; docs/scheduling.md ("Async scheduling").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvserve.core.outputs import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from kvserve.request import Request

if TYPE_CHECKING:
    from kvserve.core.kv.kv_cache_manager import KVCacheManager


def remaining_tokens(request: Request) -> int:
    """Tokens the request has yet to compute: known ones plus placeholders, minus computed."""
    return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens


def commit_scheduled(requests: Mapping[str, Request], sched: SchedulerOutput) -> None:
    """Advance every scheduled request as if its step had run: computed tokens, and one
    output placeholder for each request that samples."""
    for sr in sched.scheduled:
        request = requests[sr.request_id]
        request.num_computed_tokens += sr.num_tokens
        if sr.sample:
            request.num_output_placeholders += 1


def ends_with_placeholder(request: Request, max_model_len: int, kv: KVCacheManager) -> bool:
    """Whether the token the request is waiting for surely ends it by length (``max_tokens``,
    ``max_model_len``, or a next token that needs more blocks than the pool: the length
    rules of ``stop_checks.check_stop``): then nothing is scheduled for it ahead."""
    if not request.num_output_placeholders:
        return False
    max_tokens = request.sampling_params.max_tokens
    num_output = request.num_output_tokens + request.num_output_placeholders
    if max_tokens is not None and num_output >= max_tokens:
        return True
    num_tokens = request.num_tokens + request.num_output_placeholders
    return num_tokens >= max_model_len or kv.max_live_blocks(num_tokens) > kv.num_blocks


def take_sampled(request: Request) -> None:
    """The in-flight token of ``request`` has arrived: one placeholder fewer."""
    if request.num_output_placeholders <= 0:
        raise RuntimeError(
            f"request {request.request_id!r} got a sampled token it had no placeholder for"
        )
    request.num_output_placeholders -= 1


def can_schedule_ahead(requests: Mapping[str, Request], sched: SchedulerOutput) -> bool:
    """Whether the step after ``sched`` may be scheduled before ``sched`` has run: not when
    a request of ``sched`` still has n > 1 samples to fork (they fork on its output)."""
    for sr in sched.scheduled:
        request = requests.get(sr.request_id)
        if request is not None and request.pending_children:
            return False
    return True


def resolve_ahead(requests: Mapping[str, Request], sched: SchedulerOutput) -> list[str]:
    """Make a step scheduled ahead runnable, once the step before it has been applied.

    Drops the work of requests that have finished since (their blocks are free; a finished
    request's work ahead is at most its placeholder decode, or the rest of a failed one's
    prompt, whose blocks left the prefix cache) and replaces every placeholder by the
    sampled token. Returns the dropped request ids.
    """
    kept = []
    dropped = []
    for sr in sched.scheduled:
        request = requests.get(sr.request_id)
        if request is None:
            dropped.append(sr.request_id)
            continue
        if PLACEHOLDER_TOKEN_ID in sr.token_ids:
            end = sr.start_pos + sr.num_tokens
            if end > request.num_tokens:
                raise RuntimeError(
                    f"request {sr.request_id!r}: the token at position {end - 1} is still "
                    "unknown when its step is about to run"
                )
            sr.token_ids = request.token_ids_slice(sr.start_pos, end)
        kept.append(sr)
    sched.scheduled = kept
    return dropped
