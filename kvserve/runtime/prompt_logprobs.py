"""Prompt logprobs: the raw log-probability of each prompt token given the tokens before it,
computed from the hidden states of the prefill pass that computes those positions.

A chunk computing positions ``[s, s + n)`` scores prompt tokens ``s + 1 .. min(s + n, P - 1)``
(position ``j``'s hidden state predicts token ``j + 1``; the last prompt position predicts the
first output token, which is not a prompt token). The engine assembles the chunks; positions
served from the prefix cache have no hidden state here, so the scheduler gives requests that
ask for prompt logprobs no prefix-cache hits (see Scheduler._admit).
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.core.outputs import Logprob, LogprobsEntry
from kvserve.runtime.input_batch import InputBatch

# NOTE: rows per lm_head call: bounds the float32 logits to [64, vocab] (12.6 MB at 49k)
# however long the prefill chunk is.
_ROWS_PER_SLICE = 64


def compute_prompt_logprobs(
    model: nn.Module, hidden: torch.Tensor, batch: InputBatch
) -> dict[str, tuple[int, list[LogprobsEntry]]]:
    """Per request with ``prompt_logprobs``: (first scored position, entries). hidden: [T, H]."""
    out: dict[str, tuple[int, list[LogprobsEntry]]] = {}
    offset = 0
    for r in batch.requests:  # flat-batch order: the rows of ``hidden``
        n = len(r.token_ids)
        num_top = r.sampling_params.prompt_logprobs
        end = min(r.start_pos + n, len(r.prompt_token_ids) - 1)  # last scoring position + 1
        if num_top is not None and end > r.start_pos:
            targets = r.prompt_token_ids[r.start_pos + 1 : end + 1]
            rows = hidden[offset : offset + end - r.start_pos]  # [K, H]
            out[r.request_id] = (r.start_pos + 1, _score(model, rows, targets, num_top))
        offset += n
    return out


def _score(
    model: nn.Module, hidden: torch.Tensor, targets: list[int], num_top: int
) -> list[LogprobsEntry]:
    """Entries for ``targets[i]`` under the logits of ``hidden[i]`` ([K, H])."""
    entries: list[LogprobsEntry] = []
    for start in range(0, len(targets), _ROWS_PER_SLICE):
        chunk = targets[start : start + _ROWS_PER_SLICE]
        logits = model.compute_logits(hidden[start : start + len(chunk)])  # [k, V] float32
        logprobs = torch.log_softmax(logits, dim=-1)  # [k, V]
        ids = torch.tensor(chunk, device=logprobs.device).unsqueeze(1)  # [k, 1]
        chosen = logprobs.gather(1, ids)  # [k, 1]
        ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        chosen_list = chosen.squeeze(1).tolist()
        top_vals: list[list[float]] = [[] for _ in chunk]
        top_ids: list[list[int]] = [[] for _ in chunk]
        if num_top:
            vals, idx = torch.topk(logprobs, num_top, dim=-1)  # [k, num_top] each
            top_vals, top_ids = vals.tolist(), idx.tolist()
        for j, tid in enumerate(chunk):
            entry: LogprobsEntry = {tid: Logprob(logprob=chosen_list[j], rank=ranks[j])}
            for rank, (t, v) in enumerate(zip(top_ids[j], top_vals[j], strict=True), start=1):
                if t not in entry:
                    entry[t] = Logprob(logprob=v, rank=rank)
            entries.append(entry)
    return entries
