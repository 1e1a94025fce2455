"""Per-request timings of an online benchmark and the figures computed from them (pure Python).

Definitions (as vLLM's ``benchmark_serving``):

- TTFT: send -> first chunk that carries output text.
- ITL: gaps between successive output chunks of one request (all requests pooled).
- TPOT: (e2e - TTFT) / (output tokens - 1), per request with more than one output token.
- e2e: send -> end of the response stream.
- goodput: completed requests per second that meet every SLO given (TTFT, TPOT and/or ITL;
  the ITL objective holds for a request when the 99th percentile of its own gaps meets it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.bench.report import cdf_points
from kvserve.bench.stats import percentile, summarize


@dataclass
class RequestRecord:
    """What the client saw of one request; times are seconds on the client's clock."""

    request_id: str
    prompt_len: int
    max_tokens: int
    send_time: float
    chunk_times: list[float] = field(default_factory=list)  # absolute times of output chunks
    end_time: float | None = None
    num_output_tokens: int = 0
    ok: bool = False
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.end_time - self.send_time if self.end_time is not None else None

    @property
    def tpot(self) -> float | None:
        ttft, e2e = self.ttft, self.e2e
        if ttft is None or e2e is None or self.num_output_tokens < 2:
            return None
        return (e2e - ttft) / (self.num_output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in seconds; None = not constrained."""

    ttft: float | None = None
    tpot: float | None = None
    itl: float | None = None  # on the request's p99 inter-token gap

    def met(self, rec: RequestRecord) -> bool:
        """True when the request completed and meets every objective that is set."""
        if not rec.ok:
            return False
        if self.ttft is not None and (rec.ttft is None or rec.ttft > self.ttft):
            return False
        # NOTE: a one-token reply has no TPOT; it cannot violate a TPOT objective.
        tpot = rec.tpot
        if self.itl is not None and rec.itls and percentile(rec.itls, 99.0) > self.itl:
            return False
        return not (self.tpot is not None and tpot is not None and tpot > self.tpot)


def compute_metrics(
    records: list[RequestRecord], duration_s: float, slo: SLO | None = None
) -> dict[str, Any]:
    """Throughput, latency summaries (mean, median, p90, p99) and goodput of a run.

    ``duration_s`` is the benchmark's wall time (first send to last completion).
    Raises ValueError if it is not positive.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    slo = slo or SLO()
    done = [r for r in records if r.ok]
    num_prompt = sum(r.prompt_len for r in done)
    num_output = sum(r.num_output_tokens for r in done)
    num_good = sum(slo.met(r) for r in done)
    out: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "requests_per_s": len(done) / duration_s,
        "output_tokens_per_s": num_output / duration_s,
        "total_tokens_per_s": (num_prompt + num_output) / duration_s,
        "ttft": summarize([r.ttft for r in done if r.ttft is not None]),
        "tpot": summarize([r.tpot for r in done if r.tpot is not None]),
        "itl": summarize([g for r in done for g in r.itls]),
        "e2e": summarize([r.e2e for r in done if r.e2e is not None]),
        "slo_ttft_s": slo.ttft,
        "slo_tpot_s": slo.tpot,
        "slo_itl_s": slo.itl,
        "num_good_requests": num_good,
        "goodput_requests_per_s": num_good / duration_s,
        "slo_attainment": num_good / len(records) if records else 0.0,
    }
    errors = sorted({r.error for r in records if r.error})
    if errors:
        out["errors"] = errors[:5]
    return out


def latency_samples(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Sorted latencies of the completed requests for CDF plots, in seconds.

    ttft / tpot / e2e: one value per request; itl: every gap of every request, pooled. Each
    list is thinned to at most ``report.MAX_CDF_POINTS`` evenly spaced order statistics.
    """
    done = [r for r in records if r.ok]
    return {
        "ttft": cdf_points([v for r in done if (v := r.ttft) is not None]),
        "tpot": cdf_points([v for r in done if (v := r.tpot) is not None]),
        "itl": cdf_points([g for r in done for g in r.itls]),
        "e2e": cdf_points([v for r in done if (v := r.e2e) is not None]),
    }
