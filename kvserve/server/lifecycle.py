"""Server life cycle: a drain with a deadline on SIGTERM, a non-zero exit when the engine dies.

``Lifecycle`` is shared by the app (``/health`` says "draining", the request guard answers 503
to new requests) and ``kvserve serve`` (which hands it the uvicorn server to stop):

- first SIGTERM / SIGINT: draining starts. In-flight requests run for up to
  ``shutdown_timeout`` seconds; whatever is still running then ends with an error event (and
  ``[DONE]`` on streams), and the server stops with exit code 0.
- a second signal skips the rest of the wait the same way.
- the engine's step loop dying (a fault no request can be blamed for): every in-flight
  request has already got its error; the server stops with exit code 1, so a supervisor
  restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from kvserve.async_engine import AsyncLLMEngine, EngineDeadError
from kvserve.server.limits import DEFAULT_SHUTDOWN_TIMEOUT_S

__all__ = ["DEFAULT_SHUTDOWN_TIMEOUT_S", "Lifecycle"]

logger = logging.getLogger("kvserve.server")


class Lifecycle:
    """Draining state and the stop of the server (see the module docstring)."""

    def __init__(
        self, engine: AsyncLLMEngine, *, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    ) -> None:
        if shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {shutdown_timeout}")
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.draining = False
        self.exit_code = 0
        self.server: Any = None  # a uvicorn.Server (set by `kvserve serve`), or None in tests
        self.drain_started: float | None = None
        self.drain_seconds: float | None = None  # how long the drain took
        self.num_cut_requests = 0  # in-flight requests ended at the deadline
        self._skip_wait: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def on_signal(self) -> None:
        """SIGTERM / SIGINT, on the event loop's thread: start draining, or skip the wait."""
        if not self.draining:
            self.draining = True
            self.drain_started = time.monotonic()
            self._skip_wait = asyncio.Event()
            logger.warning(
                "draining: %d requests in flight, deadline %.0f s",
                self.engine.num_unfinished,
                self.shutdown_timeout,
            )
            self._task = asyncio.get_running_loop().create_task(self._drain())
        elif self._skip_wait is not None:
            logger.warning("second signal: ending in-flight requests now")
            self._skip_wait.set()

    def on_fatal(self, error: BaseException) -> None:
        """The engine loop died: exit non-zero once the failed requests have been answered."""
        logger.error("the engine stopped (%r); the server exits with code 1", error)
        self.exit_code = 1
        self._stop_server()

    async def _drain(self) -> None:
        assert self._skip_wait is not None and self.drain_started is not None
        deadline = self.drain_started + self.shutdown_timeout
        while self.engine.num_unfinished and not self._skip_wait.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # NOTE: polled: requests finish on the loop's own schedule, and a poll every 50 ms
            # costs nothing next to the drain.
            try:
                await asyncio.wait_for(self._skip_wait.wait(), timeout=min(left, 0.05))
            except TimeoutError:
                pass
        self.num_cut_requests = self.engine.fail_all_requests(
            EngineDeadError("the server shut down before this request finished")
        )
        self.drain_seconds = time.monotonic() - self.drain_started
        logger.warning(
            "drained in %.2f s (%d requests cut at the deadline)",
            self.drain_seconds,
            self.num_cut_requests,
        )
        self._stop_server()

    def _stop_server(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
