"""Fault isolation for one engine step: blame the requests that raise, run the others.

``execute_isolated`` runs a SchedulerOutput on the model runner. If the forward pass raises,
the step is run again in halves (bisection, scheduling order kept) until every request either
ran in a sub-batch that succeeded or raised alone; those that raised alone are the step's
culprits and are reported in ``ModelRunnerOutput.failed``. Re-running is safe because a
forward pass only writes the KV of its own requests' new positions, and writing the same
tokens at the same positions again writes the same values.

Block moves (swap-out, swap-in, copy-on-write) are not idempotent (a swap-in may overwrite
the source of the swap-out before it), so a step with moves runs them first, in a call of
their own; a fault there, or one that every request of a batch hits alone, cannot be pinned
on a request and raises ``StepFault`` (the engine stops).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from kvserve.core.outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("kvserve.engine.step_guard")

Execute = Callable[[SchedulerOutput], ModelRunnerOutput]


class StepFault(RuntimeError):
    """A fault of the step that no single request caused: the engine cannot go on."""


def execute_isolated(execute: Execute, sched: SchedulerOutput) -> ModelRunnerOutput:
    """``execute(sched)`` with per-request fault isolation (see the module docstring)."""
    has_moves = bool(sched.blocks_to_swap_out or sched.blocks_to_swap_in or sched.blocks_to_copy)
    if not has_moves or not sched.scheduled:
        moves = None
        compute = sched
    else:
        moves = SchedulerOutput(
            blocks_to_swap_out=sched.blocks_to_swap_out,
            blocks_to_swap_in=sched.blocks_to_swap_in,
            blocks_to_copy=sched.blocks_to_copy,
            finished_req_ids=sched.finished_req_ids,
            preempted_req_ids=sched.preempted_req_ids,
        )
        # NOTE: replace, not a new SchedulerOutput: the forward keeps every per-step field
        # (the structured-output bitmask among them) except the block moves done above.
        compute = dataclasses.replace(
            sched,
            blocks_to_swap_out=[],
            blocks_to_swap_in=[],
            blocks_to_copy=[],
            finished_req_ids=set(),
            preempted_req_ids=set(),
        )
    try:
        moved = execute(moves) if moves is not None else None
    except Exception as e:
        raise StepFault(f"moving KV blocks failed: {e!r}") from e
    try:
        out = execute(compute)
    except StepFault:
        raise  # by definition no request's own fault
    except Exception as e:  # noqa: BLE001 - isolated below
        if not compute.scheduled:
            raise StepFault(f"the step failed: {e!r}") from e
        logger.warning("a step of %d requests raised %r; isolating", len(compute.scheduled), e)
        out = _bisect(execute, compute, e)
    if moved is not None:
        out.swap_out_time, out.swap_in_time = moved.swap_out_time, moved.swap_in_time
        out.execute_time += moved.execute_time
    return out


def _bisect(execute: Execute, compute: SchedulerOutput, error: Exception) -> ModelRunnerOutput:
    """Run ``compute``'s requests in ever smaller sub-batches; requests that raise alone fail.

    Each sub-batch is ``compute`` with fewer requests (its other fields, such as the grammar
    bitmask matched by request id, unchanged)."""
    scheduled = compute.scheduled
    out = ModelRunnerOutput()
    if len(scheduled) == 1:
        out.failed[scheduled[0].request_id] = f"the step failed: {error!r}"
        return out
    mid = len(scheduled) // 2
    stack = [scheduled[mid:], scheduled[:mid]]  # popped first half first: scheduling order
    while stack:
        part = stack.pop()
        try:
            res = execute(dataclasses.replace(compute, scheduled=part))
        except StepFault:
            raise
        except Exception as e:  # noqa: BLE001 - narrowed down below
            if len(part) == 1:
                out.failed[part[0].request_id] = f"the step failed: {e!r}"
            else:
                half = len(part) // 2
                stack.extend([part[half:], part[:half]])
            continue
        out.sampled_token_ids.update(res.sampled_token_ids)
        out.logprobs.update(res.logprobs)
        out.failed.update(res.failed)
        out.prompt_logprobs.update(res.prompt_logprobs)
        # NOTE: speculative decoding: a sampled token is the one after the accepted drafts.
        out.spec_num_accepted.update(res.spec_num_accepted)
        out.spec_token_ids.update(res.spec_token_ids)
        out.execute_time += res.execute_time
    if len(out.failed) == len(scheduled):
        raise StepFault(
            f"every one of the step's {len(scheduled)} requests fails alone: {error!r}"
        ) from error
    return out
