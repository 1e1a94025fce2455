"""What the engine hands back to callers: one RequestOutput per request, per step or at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.core.outputs import LogprobsEntry


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request (``n`` of them when ``SamplingParams.n > 1``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that matched
    logprobs: list[LogprobsEntry] | None = None
    cumulative_logprob: float | None = None
    # Streaming: what this step added (empty for the final aggregated output of LLM.generate).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Per-request latencies in seconds (None until known)."""

    arrival_time: float
    queue_time: float | None = None  # arrival -> first scheduled
    ttft: float | None = None  # arrival -> first token
    tpot: float | None = None  # mean time per output token after the first
    e2e: float | None = None  # arrival -> finished


@dataclass(slots=True)
class RequestOutput:
    """The state of one request: prompt, its samples, and whether it is done."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    # Set when the request failed on its own (a fault in its step, non-finite logits): it is
    # finished, its blocks are freed, and ``error`` says why. The engine serves on.
    error: str | None = None
    # SamplingParams.prompt_logprobs: None for the first prompt token, then one entry per
    # prompt token (its raw logprob plus the top-N); filled once the prompt is computed.
    prompt_logprobs: list[LogprobsEntry | None] | None = None
