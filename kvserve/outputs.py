"""What the engine hands back to callers: one RequestOutput per request, per step or at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.core.outputs import LogprobsEntry

# The finish reason of a sample whose request failed but keeps its output: its grammar
# matcher ran out of a grammar-engine limit mid-generation (vLLM's FinishReason.ERROR).
FINISH_ERROR = "error"


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request (``n`` of them when ``SamplingParams.n > 1``)."""

    index: int
    text: str
    token_ids: list[int]
    # "stop", "length", "abort", "error" (FINISH_ERROR) or None while running
    finish_reason: str | None = None
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
    # finished, its blocks are freed, and ``error`` says why. The engine serves on. Its samples
    # finish with "abort", or with FINISH_ERROR where the output stands (``failed_with_output``).
    error: str | None = None
    # SamplingParams.prompt_logprobs: None for the first prompt token, then one entry per
    # prompt token (its raw logprob plus the top-N); filled once the prompt is computed.
    prompt_logprobs: list[LogprobsEntry | None] | None = None

    @property
    def failed_with_output(self) -> bool:
        """Failed (``error``) with samples that finished with FINISH_ERROR: the output so far
        is an answer (a grammar-engine limit), not lost work."""
        return self.error is not None and any(c.finish_reason == FINISH_ERROR for c in self.outputs)


def merge_outputs(pending: RequestOutput, new: RequestOutput) -> RequestOutput:
    """One output equal to reading ``pending`` then ``new`` (two steps of one request).

    Everything of an output is the request's state at its step (text, token ids, logprobs,
    finish, metrics, prompt logprobs) except each sample's ``delta_text`` and
    ``delta_token_ids``, which are what that step added: ``new`` is kept, with each sample's
    deltas being those of ``pending`` followed by its own. Returns ``new``, updated in place;
    ``pending`` must not be used afterwards (its delta lists are reused).
    """
    olds = {c.index: c for c in pending.outputs}
    for c in new.outputs:
        old = olds.pop(c.index, None)
        if old is None:
            continue
        # NOTE: extend the pending list (amortized O(new tokens)), not a fresh concatenation:
        # a reader that never reads gets a merge every step of its request.
        old.delta_token_ids.extend(c.delta_token_ids)
        c.delta_token_ids = old.delta_token_ids
        c.delta_text = old.delta_text + c.delta_text
    if olds:
        # NOTE: the engine sends every sample in every output; should a sample be missing from
        # ``new``, its pending state is kept rather than lost.
        new.outputs = sorted([*new.outputs, *olds.values()], key=lambda c: c.index)
    return new
