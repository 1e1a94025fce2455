"""Async scheduling, the engine's side: the forward thread and the record of a step in flight.

With ``EngineConfig.async_scheduling`` (vLLM's ``--async-scheduling``) ``LLMEngine.step``
overlaps a step's forward pass with the engine's own work: the forward of step N runs on
the ``ForwardThread`` while the calling thread schedules step N+1 (``core/sched/ahead.py``:
one placeholder token per sampling request), then, once step N's tokens are in, applies
them, resolves step N+1's placeholders, launches it, and detokenizes step N's tokens and
builds its outputs while step N+1 runs. A step's input tensors are built on the forward
thread, as the first part of its ``execute``.

NOTE: every torch call of such an engine runs on the forward thread, its start-up included.
libgomp keeps one pool of helper threads per thread that starts a parallel region, and once
the pools hold more threads than there are CPUs it cuts its spin-wait from
``GOMP_SPINCOUNT`` to 100 iterations (``async_engine.build_on_engine_thread``): a model
built on one thread and run on another paid that on every parallel region.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from kvserve.core.outputs import ModelRunnerOutput, SchedulerOutput

T = TypeVar("T")


class ForwardThread:
    """The one thread that runs an async-scheduling engine's torch work."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-forward")

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the forward thread and wait for its result (or exception)."""
        return self._pool.submit(fn).result()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Start ``fn`` on the forward thread (after whatever runs there now)."""
        return self._pool.submit(fn)

    def close(self) -> None:
        """Let the thread end once its queued work is done."""
        self._pool.shutdown(wait=False)


@dataclass(slots=True)
class PlannedStep:
    """One scheduled step: its SchedulerOutput, what scheduling it cost, and (once launched
    on the forward thread) its pending ModelRunnerOutput."""

    sched: SchedulerOutput
    schedule_seconds: float
    # Requests the grammar engine failed while preparing the step's bitmask (request id ->
    # reason): they still run in the forward and are failed once it has run.
    grammar_faults: dict[str, str] = field(default_factory=dict)
    future: Future[ModelRunnerOutput] | None = None


def has_work(sched: SchedulerOutput) -> bool:
    """Whether running ``sched`` does anything: requests to compute or blocks to move."""
    return bool(
        sched.scheduled
        or sched.blocks_to_swap_out
        or sched.blocks_to_swap_in
        or sched.blocks_to_copy
    )
