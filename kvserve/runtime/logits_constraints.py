"""Logit edits that come before sampling: logit_bias and the structured-output bitmask.

Both act on a copy of the raw logits, so logprobs (vLLM's raw logprobs) still describe the
model. The bitmask is the plain-data ``GrammarBitmask`` the engine filled for this step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.core.outputs import GrammarBitmask, ScheduledRequest


@dataclass(slots=True)
class RowBitmask:
    """Bitmask rows matched to logits rows: ``bitmask[j]`` constrains logits row ``rows[j]``."""

    bitmask: np.ndarray  # int32 [G, ceil(V / 32)]
    rows: list[int]


def match_bitmask_rows(
    grammar: GrammarBitmask | None, reqs: list[ScheduledRequest]
) -> RowBitmask | None:
    """The rows of ``grammar`` for the logits rows ``reqs`` (None if none is constrained)."""
    if grammar is None:
        return None
    index = {rid: j for j, rid in enumerate(grammar.request_ids)}
    pairs = [(index[r.request_id], i) for i, r in enumerate(reqs) if r.request_id in index]
    if not pairs:
        return None
    return RowBitmask(grammar.bitmask[[j for j, _ in pairs]], [i for _, i in pairs])


def apply_token_bitmask(logits: torch.Tensor, mask: RowBitmask) -> None:
    """Set the logits of tokens the bitmask forbids to -inf, in place. logits: [N, V]."""
    num_rows, vocab = len(mask.rows), logits.shape[1]
    # NOTE: the int32 words are little-endian, so the bytes' little-endian bit order is the
    # token order: bit b of byte k of a row is token 8 * k + b.
    bits = np.unpackbits(
        np.ascontiguousarray(mask.bitmask).view(np.uint8), axis=1, bitorder="little"
    )  # [G, 32 * W] uint8
    allowed = torch.from_numpy(bits[:, :vocab].view(np.bool_)).to(logits.device)  # [G, V]
    if num_rows == logits.shape[0] and mask.rows == list(range(num_rows)):
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        rows = torch.tensor(mask.rows, device=logits.device)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, reqs: list[ScheduledRequest]) -> None:
    """Add each request's ``logit_bias`` to its row, in place. logits: [N, V]."""
    vocab = logits.shape[1]
    for i, r in enumerate(reqs):
        bias = r.sampling_params.logit_bias
        if bias:
            ids = [t for t in bias if t < vocab]
            if ids:
                values = torch.tensor([bias[t] for t in ids], dtype=logits.dtype)
                logits[i, ids] += values.to(logits.device)
