"""Shared by the sampler tests: a ScheduledRequest that samples this step, random logits."""

from __future__ import annotations

import torch

from kvserve.core.outputs import ScheduledRequest
from kvserve.sampling_params import SamplingParams

VOCAB = 64


def make_req(
    request_id: str,
    params: SamplingParams,
    *,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
) -> ScheduledRequest:
    """A ScheduledRequest that samples this step."""
    prompt = [1, 2, 3] if prompt is None else prompt
    return ScheduledRequest(
        request_id=request_id,
        token_ids=[prompt[-1]],
        start_pos=len(prompt) - 1,
        block_ids=[0],
        sample=True,
        sampling_params=params,
        prompt_token_ids=prompt,
        output_token_ids=[] if output is None else output,
        seed=seed,
    )


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((num_rows, vocab), generator=gen) * 3.0  # [N, V]
