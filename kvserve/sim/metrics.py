"""Latency and throughput figures of a simulated (or replayed) run."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvserve.percentile import percentile as _percentile


@dataclass(slots=True)
class RequestTiming:
    """Virtual-clock timestamps of one request (seconds since the trace start)."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (token times, not the finish time:
        a static batch returns a request after its last token)."""
        first, last = self.first_token_time, self.last_token_time
        if first is None or last is None or self.num_output_tokens < 2:
            return None
        return (last - first) / (self.num_output_tokens - 1)


@dataclass
class LatencyRecorder:
    """Collects per-request timestamps and every inter-token gap."""

    timings: dict[str, RequestTiming] = field(default_factory=dict)
    itls: list[float] = field(default_factory=list)

    def arrive(self, request_id: str, arrival_time: float, num_prompt_tokens: int) -> None:
        self.timings[request_id] = RequestTiming(request_id, arrival_time, num_prompt_tokens)

    def token(self, request_id: str, now: float) -> None:
        """One new output token of ``request_id`` became available at ``now``."""
        t = self.timings[request_id]
        if t.first_token_time is None:
            t.first_token_time = now
        else:
            self.itls.append(now - t.last_token_time)  # type: ignore[operator]
        t.last_token_time = now
        t.num_output_tokens += 1

    def finish(self, request_id: str, now: float) -> None:
        self.timings[request_id].finish_time = now


def percentile(values: list[float] | np.ndarray, q: float) -> float:
    """The q-th percentile (0..100, linear as numpy), NaN for no values."""
    if len(values) == 0:
        return float("nan")
    return _percentile([float(v) for v in values], q)


def latency_summary(rec: LatencyRecorder, duration_s: float) -> dict[str, float]:
    """TTFT / TPOT / ITL / e2e percentiles (seconds) and throughput over ``duration_s``."""
    done = [t for t in rec.timings.values() if t.finish_time is not None]
    ttft = [t.ttft for t in done if t.ttft is not None]
    tpot = [t.tpot for t in done if t.tpot is not None]
    e2e = [t.e2e for t in done if t.e2e is not None]
    num_out = sum(t.num_output_tokens for t in done)
    num_prompt = sum(t.num_prompt_tokens for t in done)
    dur = max(duration_s, 1e-12)
    out: dict[str, float] = {
        "num_finished": float(len(done)),
        "duration_s": duration_s,
        "output_tokens_per_s": num_out / dur,
        "total_tokens_per_s": (num_out + num_prompt) / dur,
        "requests_per_s": len(done) / dur,
    }
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", rec.itls), ("e2e", e2e)):
        out[f"{name}_mean_s"] = float(np.mean(vals)) if len(vals) else float("nan")
        out[f"{name}_p50_s"] = percentile(vals, 50)
        out[f"{name}_p99_s"] = percentile(vals, 99)
    return out
