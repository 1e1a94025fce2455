"""Failing requests for faults of their own, without stopping the engine.

A request fails when its own work fails (a raise isolated by bisection, non-finite logits, a
bad draw: the runner's ``failed``), when the grammar engine fails it, or when its prefix hit
read KV that a failed request was writing in the same step. All samples of its group finish
with the reason as the output's ``error``; steps in which every request fails stop the engine
instead (``MAX_ALL_FAILED_STEPS``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.outputs import SchedulerOutput
from kvserve.core.sched.scheduler import Scheduler
from kvserve.engine.request_state import RequestGroup
from kvserve.engine.step_guard import StepFault
from kvserve.request import RequestStatus
from kvserve.structured.limits import LimitFault

logger = logging.getLogger("kvserve")

# NOTE: a fault that every request hits (a broken device, a corrupt weight) looks, one request
# at a time, like each request's own; this many steps in a row with every request failed stop
# the engine instead (so the supervisor restarts it). A single failing step never does.
MAX_ALL_FAILED_STEPS = 5


def fail_group(scheduler: Scheduler, group: RequestGroup, reason: str) -> None:
    """Finish every sample of ``group`` with an error; frees their blocks."""
    if group.error is None:
        group.error = reason
    ids = [s.request.request_id for s in group.samples if not s.request.is_finished]
    scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)


class RequestFailures:
    """Fails the requests a step's faults name, and counts them.

    ``group_of`` maps a sample's request id to its group (None for a request that is not the
    engine's own, such as a test's scheduler-level one: it is aborted at the scheduler).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        kv_cache_manager: KVCacheManager,
        group_of: Callable[[str], RequestGroup | None],
    ) -> None:
        self.scheduler = scheduler
        self.kv_cache_manager = kv_cache_manager
        self.group_of = group_of
        self.num_failed_requests = 0  # requests failed by a fault of their own
        self.num_blamed_steps = 0  # steps in a row in which every request failed

    def fail_faulted(
        self,
        sched: SchedulerOutput,
        faults: dict[str, str],
        ahead: SchedulerOutput | None = None,
    ) -> dict[str, RequestGroup]:
        """Fail every request (all samples of its group) named in ``faults``; returns them.

        Their blocks that this step should have written leave the prefix cache, then every
        block they hold is freed. MAX_ALL_FAILED_STEPS steps in a row in which every request
        failed mean the fault is not theirs: StepFault. ``ahead`` (async scheduling): the
        step already scheduled after this one; its requests that read the unwritten KV fail
        too, and the failed requests' work in it is dropped (``resolve_ahead``), so their
        blocks from it leave the prefix cache as well.
        """
        if not faults:
            self.num_blamed_steps = 0
            return {}
        num_failed = sum(1 for sr in sched.scheduled if sr.request_id in faults)
        if num_failed == len(sched.scheduled):
            self.num_blamed_steps += 1
            if self.num_blamed_steps >= MAX_ALL_FAILED_STEPS:
                raise StepFault(
                    f"{self.num_blamed_steps} steps in a row failed for every request: {faults}"
                )
        else:
            self.num_blamed_steps = 0
        steps = [sched] if ahead is None else [sched, ahead]
        unwritten = self._unwritten_blocks(sched, faults)
        # NOTE: after the blame count: they fail for the faulted ones, not on their own.
        for step in steps:
            start = {sr.request_id: sr.start_pos for sr in step.scheduled}
            faults = {**faults, **self._readers(start, unwritten, faults)}
        forget = getattr(self.kv_cache_manager, "forget_unwritten", None)
        out: dict[str, RequestGroup] = {}
        for rid, reason in faults.items():
            logger.warning("request %s failed: %s", rid, reason)
            req = self.scheduler.get_request(rid)
            first = next(
                (sr for step in steps for sr in step.scheduled if sr.request_id == rid), None
            )
            if req is not None and forget is not None and first is not None:
                forget(req, first.start_pos, first.block_ids)
            group = self.group_of(rid)
            if group is None:  # not the engine's own (a test's scheduler-level request)
                self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                continue
            fail_group(self.scheduler, group, reason)
            out[group.request_id] = group
        self.num_failed_requests += len(out)
        return out

    def _unwritten_blocks(self, sched: SchedulerOutput, faults: dict[str, str]) -> dict[int, str]:
        """Block id -> the faulted request that was writing it in ``sched``: its blocks from
        its first position in the step on, in its table now and in the step's table."""
        bs = self.kv_cache_manager.block_size
        unwritten: dict[int, str] = {}
        for sr in sched.scheduled:
            if sr.request_id in faults:
                first = sr.start_pos // bs
                live = self.kv_cache_manager.get_block_ids(sr.request_id)[first:]
                for bid in (*live, *sr.block_ids[first:]):
                    unwritten.setdefault(bid, sr.request_id)
        return unwritten

    def _readers(
        self, start: dict[str, int], unwritten: dict[int, str], faults: dict[str, str]
    ) -> dict[str, str]:
        """The requests of a step (``start``: each one's first position computed in it) not
        in ``faults`` whose table holds an ``unwritten`` block among the positions before it:
        their prefix hit took blocks a faulted request was writing, so their forward reads
        KV that was never written and they fail too.

        NOTE: failing them is the honest outcome the step allows: their sampled tokens come
        from garbage, and the blocks they matched will never hold the right KV. (A prefix
        hit on blocks computed in an earlier step is unaffected.)
        """
        bs = self.kv_cache_manager.block_size
        readers = {}
        for rid, first in start.items():
            if rid in faults:
                continue
            # the blocks of the positions it did not compute itself in this step
            for bid in self.kv_cache_manager.get_block_ids(rid)[: -(-first // bs)]:
                if bid in unwritten:
                    readers[rid] = (
                        f"its prefix-cache hit was on KV that request {unwritten[bid]!r} was "
                        "writing in the same step, which failed: the KV was never written"
                    )
                    break
        return readers

    def fail_grammar_faults(self, faults: dict[str, str]) -> dict[str, RequestGroup]:
        """Fail every request (all samples of its group) the grammar engine failed (request
        id -> reason, from StructuredOutputManager); returns them. Unlike a runner fault, the
        KV of their step was written: their blocks stay valid for prefix hits. A reason that
        is a ``LimitFault`` finishes the request's samples with "error" (FINISH_ERROR)."""
        out: dict[str, RequestGroup] = {}
        for rid, reason in faults.items():
            group = self.group_of(rid)
            if group is None:  # not the engine's own (a test's scheduler-level request)
                self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                continue
            if group.error is not None:
                continue  # already failed in this step (a runner fault)
            # NOTE: a limit the matcher ran out of ends the request with finish reason
            # "error" and its text so far (issue 51); any other grammar fault, like a runner
            # fault, fails it without output.
            group.error_finish = isinstance(reason, LimitFault)
            fail_group(self.scheduler, group, reason)
            out[group.request_id] = group
        self.num_failed_requests += len(out)
        return out
