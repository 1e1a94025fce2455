"""The drain's deadline accounting (``kvserve/server/lifecycle.py``) on fakes: the deadlines
count from the signal's arrival, requests are cut before the stop begins, the stop is given
only what is left before the exit deadline. Ordering and arithmetic, not wall-clock tightness.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvserve.server.lifecycle import STOP_RESERVE_S, Lifecycle, stop_reserve


@dataclass
class FakeEngine:
    """Always one request in flight, until ``fail_all_requests`` cuts it."""

    events: list[tuple[str, float]]
    num_unfinished: int = 1

    def fail_all_requests(self, error: BaseException) -> int:
        self.events.append(("cut", time.monotonic()))
        cut, self.num_unfinished = self.num_unfinished, 0
        return cut


@dataclass
class FakeConfig:
    timeout_graceful_shutdown: float | None = None


@dataclass
class FakeServer:
    """Records when ``should_exit`` is set (what ``kvserve serve``'s uvicorn server reads)."""

    events: list[tuple[str, float]]
    config: FakeConfig = field(default_factory=FakeConfig)
    _should_exit: bool = False

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self.events.append(("stop", time.monotonic()))
        self._should_exit = value


def test_stop_reserve_is_bounded_and_leaves_most_of_a_short_timeout() -> None:
    assert stop_reserve(30.0) == STOP_RESERVE_S
    assert stop_reserve(0.4) == pytest.approx(0.1)
    assert stop_reserve(0.0) == 0.0


def test_deadlines_count_from_the_signal_and_the_cut_precedes_the_stop() -> None:
    events: list[tuple[str, float]] = []
    timeout = 0.8

    async def main() -> Lifecycle:
        life = Lifecycle(FakeEngine(events), shutdown_timeout=timeout)  # type: ignore[arg-type]
        server: Any = FakeServer(events)
        life.server = server
        # NOTE: the loop got to the signal 0.3 s after it arrived: that time is spent.
        arrived = time.monotonic() - 0.3
        life.on_signal(arrived)
        assert life.exit_deadline == pytest.approx(arrived + timeout)
        assert life.cut_deadline == pytest.approx(arrived + timeout - stop_reserve(timeout))
        assert not life.exit_backstop  # (`kvserve serve` arms it: it would end pytest)
        await life.drained()
        return life

    life = asyncio.run(main())
    assert [name for name, _ in events] == ["cut", "stop"]
    (_, cut_at), (_, stop_at) = events
    assert life.cut_deadline is not None and life.exit_deadline is not None
    assert life.drain_started is not None
    assert cut_at >= life.cut_deadline  # requests ran until the cut deadline...
    assert stop_at >= cut_at  # ...were cut, then the server was told to stop,
    # ...with uvicorn's grace period limited to what was left before the exit deadline.
    grace = life.server.config.timeout_graceful_shutdown
    assert grace is not None and grace <= life.exit_deadline - cut_at
    assert life.num_cut_requests == 1
    assert life.drain_seconds is not None
    assert life.drain_seconds >= life.cut_deadline - life.drain_started


def test_second_signal_cuts_at_once_and_keeps_the_first_deadline() -> None:
    events: list[tuple[str, float]] = []

    async def main() -> Lifecycle:
        life = Lifecycle(FakeEngine(events), shutdown_timeout=60.0)  # type: ignore[arg-type]
        life.on_signal()
        first = life.exit_deadline
        await asyncio.sleep(0.05)
        life.on_signal()  # the second signal skips the wait
        await life.drained()
        assert life.exit_deadline == first
        return life

    life = asyncio.run(main())
    assert [name for name, _ in events] == ["cut"]  # no server to stop in this test
    assert life.cut_deadline is not None and events[0][1] < life.cut_deadline
