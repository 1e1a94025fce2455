"""Server life cycle: a drain with a deadline on SIGTERM, a non-zero exit when the engine dies.

``Lifecycle`` is shared by the app (``/health`` says "draining", the request guard answers 503
to new requests) and ``kvserve serve`` (which hands it the uvicorn server to stop):

- first SIGTERM / SIGINT: draining starts. The process exits within ``shutdown_timeout``
  seconds of the signal's arrival (``exit_deadline``): in-flight requests run until
  ``cut_deadline`` (the exit deadline less ``stop_reserve``, the time the server's own stop
  takes: ending the streams, closing connections); whatever is still running then ends with
  an error event (and ``[DONE]`` on streams), and the server stops with exit code 0. A
  backstop timer exits the process at the exit deadline should that stop hang.
- a second signal skips the rest of the wait the same way.
- the engine's step loop dying (a fault no request can be blamed for): every in-flight
  request has already got its error; the server stops with exit code 1, so a supervisor
  restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from typing import Any

from kvserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from kvserve.server.limits import DEFAULT_SHUTDOWN_TIMEOUT_S

__all__ = ["DEFAULT_SHUTDOWN_TIMEOUT_S", "STOP_RESERVE_S", "Lifecycle", "stop_reserve"]

logger = logging.getLogger("kvserve.server")

# NOTE: what the server's stop takes after the requests are cut: uvicorn notices should_exit
# on its 0.1 s tick, waits 0.1 s, then polls the connections every 0.1 s until the ended
# streams have closed (0.2-0.35 s measured with a tiny model; the issue #20 soak exited 0.5 s
# past a 30 s deadline when the cut came at the deadline itself).
STOP_RESERVE_S = 1.0


def stop_reserve(shutdown_timeout: float) -> float:
    """Seconds before the exit deadline at which in-flight requests are cut: STOP_RESERVE_S,
    or a quarter of a shorter ``shutdown_timeout``."""
    return min(STOP_RESERVE_S, shutdown_timeout / 4)


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
        self.exit_backstop = False  # `kvserve serve`: exit the process at the exit deadline
        self.drain_started: float | None = None  # monotonic time the signal arrived
        self.exit_deadline: float | None = None  # the process is gone by then
        self.cut_deadline: float | None = None  # in-flight requests are cut by then
        self.drain_seconds: float | None = None  # from the signal to the cut
        self.num_cut_requests = 0  # in-flight requests ended at the deadline
        self._skip_wait: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def on_signal(self, signal_time: float | None = None) -> None:
        """SIGTERM / SIGINT, on the event loop's thread: start draining, or skip the wait.

        ``signal_time``: monotonic time the signal arrived (the handler's; the loop may run
        this callback later); the deadlines count from it. Default: now.
        """
        if not self.draining:
            self.draining = True
            start = time.monotonic() if signal_time is None else signal_time
            self.drain_started = start
            self.exit_deadline = start + self.shutdown_timeout
            self.cut_deadline = self.exit_deadline - stop_reserve(self.shutdown_timeout)
            self._skip_wait = asyncio.Event()
            if self.exit_backstop:
                self._arm_backstop(self.exit_deadline)
            logger.warning(
                "draining: %d requests in flight, deadline %.0f s",
                self.engine.num_unfinished,
                self.shutdown_timeout,
            )
            self._task = asyncio.get_running_loop().create_task(self._drain())
        elif self._skip_wait is not None:
            logger.warning("second signal: ending in-flight requests now")
            self._skip_wait.set()

    async def drained(self) -> None:
        """Wait until the drain started by a signal is over (returns at once without one)."""
        if self._task is not None:
            await self._task

    def on_fatal(self, error: BaseException) -> None:
        """The engine loop died: exit non-zero once the failed requests have been answered."""
        logger.error("the engine stopped (%r); the server exits with code 1", error)
        self.exit_code = 1
        self._stop_server()

    async def _drain(self) -> None:
        assert self._skip_wait is not None and self.drain_started is not None
        assert self.cut_deadline is not None
        deadline = self.cut_deadline
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
        if self.server is None:
            return
        if self.exit_deadline is not None:
            # NOTE: uvicorn waits for connections to close for at most this long, then
            # cancels their tasks; the backstop covers the rest of its stop.
            left = max(0.0, self.exit_deadline - time.monotonic())
            self.server.config.timeout_graceful_shutdown = left
        self.server.should_exit = True

    def _arm_backstop(self, exit_deadline: float) -> None:
        """Exit the process at ``exit_deadline`` if the stop has not ended it by then."""

        def backstop() -> None:
            logger.error("the server's stop outlasted the shutdown deadline: exiting now")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(int(self.exit_code))

        timer = threading.Timer(max(0.0, exit_deadline - time.monotonic()), backstop)
        timer.daemon = True
        timer.start()
