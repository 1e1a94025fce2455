"""The engine's state of one user request (its samples, their detokenizers and logprobs) and
the ``RequestOutput`` built from it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.core.outputs import LogprobsEntry
from kvserve.detokenizer import IncrementalDetokenizer
from kvserve.outputs import FINISH_ERROR, CompletionOutput, RequestMetrics, RequestOutput
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


@dataclass
class SampleState:
    """Engine-side state of one sample: its detokenizer and logprobs."""

    request: Request
    detok: IncrementalDetokenizer
    logprobs: list[LogprobsEntry] | None
    cumulative_logprob: float = 0.0
    num_emitted_tokens: int = 0  # tokens already reported as deltas
    num_emitted_chars: int = 0  # characters of text already reported as deltas
    last_token_time: float | None = None


@dataclass
class RequestGroup:
    """All samples of one user request (n of them) plus what the caller gave us."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState] = field(default_factory=list)
    reported_finished: bool = False
    error: str | None = None  # why it failed (a fault of its own), if it did
    # Failed by a grammar-engine limit: the samples it ended finish with FINISH_ERROR, not
    # "abort", and the output stands (failures.fail_grammar_faults).
    error_finish: bool = False
    prompt_logprobs: list[LogprobsEntry | None] | None = None


def make_output(group: RequestGroup, *, delta: bool) -> RequestOutput:
    """The group's ``RequestOutput``; with ``delta``, also what is new since the last one
    (and marks it as reported)."""
    completions = []
    for s in group.samples:
        req = s.request
        text = s.detok.text
        delta_ids = req.output_token_ids[s.num_emitted_tokens :] if delta else []
        delta_text = text[s.num_emitted_chars :] if delta else ""
        finish_reason = req.finish_reason
        if group.error_finish and finish_reason == "abort":
            finish_reason = FINISH_ERROR
        if delta:
            s.num_emitted_tokens = req.num_output_tokens
            s.num_emitted_chars = len(text)
        completions.append(
            CompletionOutput(
                index=req.sample_index,
                text=text,
                token_ids=list(req.output_token_ids),
                finish_reason=finish_reason,
                stop_reason=req.stop_reason,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                delta_text=delta_text,
                delta_token_ids=delta_ids,
            )
        )
    head = group.samples[0].request
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids,
        outputs=completions,
        finished=all(s.request.is_finished for s in group.samples),
        num_cached_tokens=max(head.num_cached_tokens, 0),
        metrics=request_metrics([s.request for s in group.samples]),
        error=group.error,
        prompt_logprobs=list(group.prompt_logprobs) if group.prompt_logprobs is not None else None,
    )


def request_metrics(samples: list[Request]) -> RequestMetrics:
    """The request's latencies: the first sample's, but e2e ends with its last sample."""
    req = samples[0]
    m = RequestMetrics(arrival_time=req.arrival_time)
    if req.first_scheduled_time is not None:
        m.queue_time = req.first_scheduled_time - req.arrival_time
    if req.first_token_time is not None:
        m.ttft = req.first_token_time - req.arrival_time
        if req.last_token_time is not None and req.num_output_tokens > 1:
            m.tpot = (req.last_token_time - req.first_token_time) / (req.num_output_tokens - 1)
    # NOTE: an n > 1 request finishes with its last sample (a forked sample samples a step
    # after the first one, or waits for a seat), not with the first.
    ends = [s.finished_time for s in samples]
    if all(t is not None for t in ends):
        m.e2e = max(t for t in ends if t is not None) - req.arrival_time
    return m
