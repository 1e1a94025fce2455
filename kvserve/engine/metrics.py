"""Per-request latency figures (TTFT, TPOT, ITL, e2e, queue time) kept by the engine."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.percentile import percentile
from kvserve.request import Request

# NOTE: the samples each figure keeps: the latest ones. Kept whole, an engine serving for
# days grew one float per generated token without end, and every stats() call (the server's
# /metrics scrape, on the engine thread) sorted them all: 0.5 s at a million samples.
LATENCY_WINDOW = 10_000


def _window() -> deque[float]:
    return deque(maxlen=LATENCY_WINDOW)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean / p50 / p90 / p99 / max of ``values`` (all 0.0 when empty)."""
    values = list(values)
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "count": 0}
    return {
        "mean": sum(values) / len(values),
        "p50": percentile(values, 50.0),
        "p90": percentile(values, 90.0),
        "p99": percentile(values, 99.0),
        "max": max(values),
        "count": len(values),
    }


@dataclass
class LatencyStats:
    """Latency samples of finished requests, plus inter-token gaps as they happen: the
    latest ``LATENCY_WINDOW`` of each figure (``count`` in a summary: the samples it holds)."""

    ttft: deque[float] = field(default_factory=_window)
    tpot: deque[float] = field(default_factory=_window)
    itl: deque[float] = field(default_factory=_window)
    e2e: deque[float] = field(default_factory=_window)
    queue_time: deque[float] = field(default_factory=_window)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0

    def record_token(self, gap: float | None, num_tokens: int = 1) -> None:
        """``num_tokens`` generated tokens of one request in one step (more than one with
        speculative decoding); ``gap`` is the time since the request's previous ones."""
        self.num_generation_tokens += num_tokens
        if gap is not None:
            self.itl.append(gap)

    def record_finished(self, req: Request) -> None:
        """Fold one finished request's timestamps into the figures."""
        if req.first_scheduled_time is not None:
            self.queue_time.append(req.first_scheduled_time - req.arrival_time)
        if req.first_token_time is not None:
            self.ttft.append(req.first_token_time - req.arrival_time)
            if req.last_token_time is not None and req.num_output_tokens > 1:
                self.tpot.append(
                    (req.last_token_time - req.first_token_time) / (req.num_output_tokens - 1)
                )
        if req.finished_time is not None:
            self.e2e.append(req.finished_time - req.arrival_time)

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{"ttft": {...}, "tpot": {...}, ...}`` summaries in seconds."""
        return {
            "ttft": summarize(self.ttft),
            "tpot": summarize(self.tpot),
            "itl": summarize(self.itl),
            "e2e": summarize(self.e2e),
            "queue_time": summarize(self.queue_time),
        }
