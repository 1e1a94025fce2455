"""``serve --data-parallel-size``'s SIGTERM handling (``exit_on_sigterm``): the first SIGTERM
raises SystemExit, so the replicas' clean-up runs; a second one during that clean-up is
logged, not raised."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator

import pytest

from kvserve.router.data_parallel import exit_on_sigterm


@pytest.fixture
def restore_sigterm() -> Iterator[None]:
    old = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, old)


@pytest.mark.usefixtures("restore_sigterm")
def test_a_second_sigterm_does_not_cut_the_clean_up_short(
    caplog: pytest.LogCaptureFixture,
) -> None:
    exit_on_sigterm()
    cleaned = []
    with pytest.raises(SystemExit) as stopped:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        finally:
            with caplog.at_level(logging.WARNING, logger="kvserve.router"):
                os.kill(os.getpid(), signal.SIGTERM)  # during the clean-up
            cleaned.append("replicas stopped")
    assert stopped.value.code == 0
    assert cleaned == ["replicas stopped"]
    assert "already stopping" in caplog.text
