"""The only types that cross from the scheduler (core/) to the model runner and back.

Plain dataclasses of ints and lists: the runner never sees or mutates a Request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.sampling_params import SamplingParams

# Async scheduling: the input token of a decode scheduled before the step that samples it has
# run. ``Scheduler.resolve_ahead`` replaces it by the sampled token before the step runs; the
# runner never sees it.
PLACEHOLDER_TOKEN_ID = -1
# Speculative decoding with a draft model: a draft token the scheduler leaves to the runner,
# which runs the draft model and reports what it proposed (``ModelRunnerOutput.spec_token_ids``).
DRAFT_PLACEHOLDER_TOKEN_ID = -2


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    The runner computes KV for ``token_ids`` at positions
    ``[start_pos, start_pos + len(token_ids))`` and writes it through ``block_ids``.
    If ``sample`` is true the step reaches the end of the known tokens, so the runner
    samples one next token from the logits of the last scheduled position.
    """

    request_id: str
    token_ids: list[int]  # the tokens whose KV this step computes
    start_pos: int  # == request.num_computed_tokens before the step
    block_ids: list[int]  # the whole block table (covers start_pos + len(token_ids) tokens)
    sample: bool
    sampling_params: SamplingParams
    # Read-only views for penalties / seeded draws (the runner must not mutate them).
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Seed of this sample's draws (runtime/sampler/): SamplingParams.seed + sample_index, or None.
    seed: int | None = None
    # Hybrid KV cache (core/kv/hybrid.py): every KV cache group's table, in group order
    # (``block_ids`` is group 0's); None for a single-group cache.
    group_block_ids: list[list[int]] | None = None
    # Speculative decoding: the draft tokens at the end of ``token_ids`` (unverified, not in
    # the request's tokens). The runner samples at each of the last len + 1 positions and
    # reports how many drafts the target's samples confirmed (``spec_num_accepted``).
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class GrammarBitmask:
    """Allowed next tokens of the constrained (structured-output) requests of one step.

    Row i belongs to ``request_ids[i]``; bit b of word w (little-endian int32 words) allows
    token ``32 * w + b``. The sampler sets every other logit to -inf before temperature,
    top-k and top-p. Plain data: the matchers that fill it stay in the engine.
    """

    request_ids: list[str]
    bitmask: Any  # numpy int32 [len(request_ids), ceil(vocab / 32)]


@dataclass(slots=True)
class SchedulerOutput:
    """Everything the runner needs for one step.

    Order of execution in the runner: swap-out, swap-in, copy, then the forward pass.
    (Blocks freed by a swap-out may be reused by a swap-in or a new allocation in the same
    step, so swap-out must go first.)
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device
    finished_req_ids: set[str] = field(default_factory=set)  # runner may drop their state
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured output: allowed next tokens of the constrained requests that sample (set by
    # the engine after schedule(); None when no scheduled request is constrained).
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out and not self.blocks_to_swap_in


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token, with its rank in the distribution (1 = most likely)."""

    logprob: float
    rank: int


# token id -> Logprob; holds the sampled token plus the top-N.
LogprobsEntry = dict[int, Logprob]


@dataclass(slots=True)
class ModelRunnerOutput:
    """What the runner returns: one sampled token per request whose ``sample`` was true."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, LogprobsEntry] = field(default_factory=dict)
    execute_time: float = 0.0  # seconds spent in the runner for this step
    # Of which copying blocks_to_swap_out (device -> host) and blocks_to_swap_in (host ->
    # device); measured after the copies finished (synchronized on CUDA). 0.0 when none.
    swap_out_time: float = 0.0
    swap_in_time: float = 0.0
    # Requests whose own work failed in this step (non-finite logits, a sampling error, an
    # out-of-vocabulary id), by id -> reason; they have no entry in sampled_token_ids.
    failed: dict[str, str] = field(default_factory=dict)
    # request id -> (position of the first scored prompt token, one entry per scored token:
    # that prompt token's raw logprob and the top-N), for requests with prompt_logprobs.
    prompt_logprobs: dict[str, tuple[int, list[LogprobsEntry]]] = field(default_factory=dict)
    # Speculative decoding: request id -> how many of its draft tokens were accepted (a
    # prefix of ``spec_token_ids``); ``sampled_token_ids`` holds the token sampled after them.
    spec_num_accepted: dict[str, int] = field(default_factory=dict)
    # Draft-model speculation: request id -> the draft tokens the runner's draft model put in
    # place of the scheduler's ``DRAFT_PLACEHOLDER_TOKEN_ID``s (the ones verified).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
