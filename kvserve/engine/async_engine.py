"""AsyncLLMEngine: runs the synchronous LLMEngine's step loop behind an asyncio API.

Every call into the engine (add, abort, step, stats, integrity checks) runs on one worker
thread, in submission order, so the engine never sees two callers at once and the event loop
keeps serving while a step (10-100 ms of CPU work) runs. One asyncio task drives the loop:
it submits ``step()`` to the worker, waits for it, and routes each RequestOutput to the
RequestStream of its request, which holds at most one unread output (later ones merge into
it). That stream is the only coordination point between a request's handler and the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from kvserve.engine.engine_like import EngineLike
from kvserve.outputs import RequestOutput, merge_outputs
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve.engine.async_engine")

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The step loop has died: no request can be served any more."""


class QueueFullError(RuntimeError):
    """More requests are queued than ``max_queued_requests`` allows."""


class RequestFailedError(RuntimeError):
    """This request failed on its own (a fault in its step); the engine serves on."""


class OutputObserver(Protocol):
    """Sees every output routed to a live request (used for latency metrics)."""

    def on_output(self, output: RequestOutput) -> None: ...

    def on_request_done(self, request_id: str) -> None: ...


class RequestStream:
    """Async iterator over one request's RequestOutputs (per-step deltas); ends when finished.

    Holds at most one unread output: an output routed while the previous one is unread is
    merged into it (``outputs.merge_outputs``), so a consumer that reads every step gets one
    output per step, and a slow one fewer outputs whose deltas span several steps, with the
    same tokens, text and logprobs in total. Raises EngineDeadError (or the request's own
    error) after any unread output once the request has failed.
    ``abort()`` (idempotent) cancels the request in the engine and frees its blocks.
    """

    def __init__(self, request_id: str, on_abort: Callable[[RequestStream], None]) -> None:
        self.request_id = request_id
        self.finished = False
        # Outputs taken by the consumer: each is one step's output, or several merged.
        self.num_outputs = 0
        # Outputs routed here by the loop: one per engine step that touched the request.
        self.num_received = 0
        self._on_abort = on_abort
        # NOTE: one pending output and a terminal error, not a queue: a consumer that stops
        # reading (a stalled HTTP client) would otherwise queue one output per step, each
        # with copies of the whole token and logprob lists (memory quadratic in its length).
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()  # set while __anext__ would not wait

    @property
    def num_pending(self) -> int:
        """Items waiting for the consumer: the unread (merged) output and the error, 0-2."""
        return (self._pending is not None) + (self._error is not None)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called by the loop task only (same thread as the consumer). An output merges into
        the unread one; an exception ends the stream after it (the first one is kept)."""
        if isinstance(item, BaseException):
            if self._error is None:
                self._error = item
        else:
            self.num_received += 1
            pending = self._pending
            self._pending = item if pending is None else merge_outputs(pending, item)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        await self.wait_ready()
        if self.finished:
            raise StopAsyncIteration
        if self._pending is not None:
            out, self._pending = self._pending, None
            if self._error is None:
                self._ready.clear()
            self.num_outputs += 1
            if out.finished:
                self.finished = True
            return out
        assert self._error is not None
        self.finished = True
        raise self._error

    async def wait_ready(self) -> None:
        """Return once ``__anext__`` would not wait: an output or an error is pending, or the
        stream has ended. Takes nothing (a reader of several streams waits on all at once)."""
        if not self.finished:
            await self._ready.wait()

    def abort(self) -> None:
        """Abort the request unless it already finished (safe to call from ``finally``)."""
        if not self.finished:
            self.finished = True
            self._pending = None  # NOTE: nobody will read it: free its lists now
            self._ready.set()  # a consumer waiting on the stream ends
            self._on_abort(self)


class AsyncLLMEngine:
    """Serve an engine from asyncio: ``add_request`` returns a RequestStream.

    ``max_queued_requests`` bounds the waiting queue: requests accepted that have no seat to
    go to (the scheduler's waiting requests beyond its free seats); beyond it ``add_request``
    raises QueueFullError at once. (An engine without a scheduler, e.g. a test's fake, counts
    accepted requests without output instead.)
    ``on_fatal`` is called once if the step loop dies (after every stream got the error).
    The loop task starts on first use (or ``start()``) in the running event loop.
    """

    def __init__(
        self,
        engine: EngineLike,
        *,
        max_queued_requests: int | None = None,
        observer: OutputObserver | None = None,
        executor: ThreadPoolExecutor | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``executor``: a one-worker executor, the engine thread (e.g. the one
        ``build_on_engine_thread`` built the engine on; None: a new one). NOTE: one worker:
        steps, adds and aborts must never run at once."""
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.observer = observer
        self.on_fatal = on_fatal
        self.dead_error: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}
        self._executor = executor if executor is not None else engine_thread()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._last_stats: dict[str, Any] = {}

    # ---- life cycle -----------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        """True once the step loop has raised; every later request fails."""
        return self.dead_error is not None

    @property
    def num_unfinished(self) -> int:
        """Requests with an open stream (accepted and not finished or aborted)."""
        return len(self._streams)

    @property
    def num_queued(self) -> int:
        """Accepted requests that have not produced any output yet."""
        return sum(1 for s in self._streams.values() if s.num_received == 0)

    def start(self) -> None:
        """Start the loop task in the running event loop (no-op if it runs already)."""
        loop = asyncio.get_running_loop()
        if self._task is not None and self._loop is loop and not self._task.done():
            return
        if self._task is not None and self._loop is not loop:
            raise RuntimeError("AsyncLLMEngine is bound to another event loop")
        if self._task is not None:
            return  # the loop ended (dead or shut down); do not restart it
        self._loop = loop
        self._wakeup = asyncio.Event()
        self._task = loop.create_task(self._run_loop(), name="kvserve-step-loop")

    async def shutdown(self) -> None:
        """Stop the loop, fail pending requests and release the worker thread."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.dead_error is None:
            self.dead_error = EngineDeadError("the engine was shut down")
        self._fail_all(EngineDeadError("the server is shutting down"))
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- requests -------------------------------------------------------------------------

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Validate and queue a request; returns its stream.

        Raises ValueError (bad or never-fitting input, nothing queued), QueueFullError or
        EngineDeadError.
        """
        self._check_alive()
        self.start()
        limit = self.max_queued_requests
        if limit is not None and self._scheduler() is None and self.num_queued >= limit:
            raise QueueFullError(
                f"too many queued requests ({self.num_queued} >= "
                f"max_queued_requests={limit}); retry later"
            )
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        # NOTE: the stream is registered before the add so no output can arrive unrouted.
        stream = RequestStream(request_id, self._abort)
        self._streams[request_id] = stream
        try:

            def add() -> None:
                # NOTE: on the engine thread, so the queue depth is exact (no step between).
                self._check_queue_depth()
                self.engine.add_request(
                    prompt, params, request_id=request_id, priority=priority, cache_salt=cache_salt
                )

            await self.run_in_engine(add)
        except BaseException as e:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            stream.finished = True
            if isinstance(e, asyncio.CancelledError):
                # NOTE: the caller was cancelled (a client disconnect), not the add, which may
                # have run or be running on the engine thread: abort it there, after the add.
                self._abort_in_engine(request_id)
            raise
        assert self._wakeup is not None
        self._wakeup.set()
        return stream

    def _scheduler(self) -> Any:
        """The engine's scheduler when it reports seats (LLMEngine), else None."""
        scheduler = getattr(self.engine, "scheduler", None)
        return scheduler if hasattr(scheduler, "num_free_seats") else None

    def _check_queue_depth(self) -> None:
        """QueueFullError if the waiting requests beyond the free seats reach the limit."""
        scheduler = self._scheduler()
        if self.max_queued_requests is None or scheduler is None:
            return
        depth = max(0, scheduler.num_waiting - scheduler.num_free_seats)
        if depth >= self.max_queued_requests:
            raise QueueFullError(
                f"too many queued requests ({depth} waiting for a seat >= "
                f"max_queued_requests={self.max_queued_requests}); retry later"
            )

    def fail_all_requests(self, error: BaseException) -> int:
        """End every open stream with ``error`` and abort its request; returns how many."""
        streams = list(self._streams.values())
        self._fail_all(error)
        if not self.is_dead and self._loop is not None and not self._loop.is_closed():
            for stream in streams:
                fut = self._loop.run_in_executor(
                    self._executor, self.engine.abort_request, stream.request_id
                )
                fut.add_done_callback(_log_failure)
        return len(streams)

    def abort(self, request_id: str) -> None:
        """Abort a request in the engine (fire and forget; runs before the next step)."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.abort()

    def _abort(self, stream: RequestStream) -> None:
        """A stream's ``abort()``: forget it and abort its request in the engine."""
        # NOTE: only a stream the loop still routes to. One that has ended (its final output
        # or error is pending, unread) has no request in the engine, and its id may name a
        # newer request by now: popping and aborting that one would leave its stream hanging.
        if self._streams.get(stream.request_id) is not stream:
            return
        del self._streams[stream.request_id]
        if self.observer is not None:
            self.observer.on_request_done(stream.request_id)
        self._abort_in_engine(stream.request_id)

    def _abort_in_engine(self, request_id: str) -> None:
        """Submit ``engine.abort_request`` to the engine thread (after what is queued there)."""
        if self.is_dead or self._loop is None or self._loop.is_closed():
            return
        fut = self._loop.run_in_executor(self._executor, self.engine.abort_request, request_id)
        fut.add_done_callback(_log_failure)

    async def run_in_engine(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread, serialized with steps, adds and aborts."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn)

    async def stats(self) -> dict[str, Any]:
        """``engine.stats()`` taken on the engine thread (the last good one if the loop died)."""
        if not self.is_dead:
            with contextlib.suppress(Exception):
                self._last_stats = await self.run_in_engine(self.engine.stats)
        return self._last_stats

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop has died: {self.dead_error!r}")

    # ---- the loop -------------------------------------------------------------------------

    def _step_if_busy(self) -> list[RequestOutput] | None:
        if not self.engine.has_unfinished_requests():
            return None
        return self.engine.step()

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        try:
            while True:
                # NOTE: clear before looking for work: an add that lands after the check sets
                # the event again, so the wait below cannot miss it.
                self._wakeup.clear()
                outputs = await loop.run_in_executor(self._executor, self._step_if_busy)
                if outputs is None:
                    await self._wakeup.wait()
                    continue
                for out in outputs:
                    self._dispatch(out)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            logger.exception("the engine step loop died")
            self.dead_error = e
            self._fail_all(EngineDeadError(f"the engine loop has died: {e!r}"))
            if self.on_fatal is not None:
                self.on_fatal(e)

    def _dispatch(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return  # aborted: its late outputs are dropped
        if out.error is not None and not out.failed_with_output:
            # NOTE: the request failed on its own: its stream ends with the error. One that
            # failed with its output (finish reason "error") is delivered as a final output.
            del self._streams[out.request_id]
            stream.put(RequestFailedError(out.error))
            if self.observer is not None:
                self.observer.on_request_done(out.request_id)
            return
        if self.observer is not None:
            self.observer.on_output(out)
        stream.put(out)
        if out.finished:
            del self._streams[out.request_id]
            if self.observer is not None:
                self.observer.on_request_done(out.request_id)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(error)
            if self.observer is not None:
                self.observer.on_request_done(stream.request_id)


def engine_thread() -> ThreadPoolExecutor:
    """A one-worker executor: the thread that steps an engine."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-engine")


def build_on_engine_thread(factory: Callable[[], T]) -> tuple[T, ThreadPoolExecutor]:
    """Build an engine on a fresh engine thread; returns it and that thread's executor.

    NOTE: build on the thread that will step it, so that one thread runs all of torch's
    parallel work. libgomp keeps one pool of helper threads per thread that starts a parallel
    region; once the pools hold more threads than there are CPUs (a model loaded on the main
    thread, then stepped on another), it cuts its spin-wait before sleeping from
    ``GOMP_SPINCOUNT`` to 100 iterations, and every parallel region of a step then wakes its
    helper through a futex. Measured on the 2-core box (128-token requests one at a time
    through the server): TPOT 51 ms with the engine built on the main thread, vs a 35 ms
    decode step offline.
    """
    executor = engine_thread()
    try:
        return executor.submit(factory).result(), executor
    except BaseException:
        executor.shutdown(wait=False)
        raise


def _log_failure(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        logger.error("abort_request failed: %r", fut.exception())
