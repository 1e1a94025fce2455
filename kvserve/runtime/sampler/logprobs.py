"""Raw logprobs entries of the sampled tokens (vLLM's default: the log-softmax of the model's
logits before penalties, temperature and truncation)."""

from __future__ import annotations

import torch

from kvserve.core.outputs import Logprob, LogprobsEntry, ScheduledRequest


def logprobs_entries(
    logits: torch.Tensor, token_ids: list[int], reqs: list[ScheduledRequest]
) -> list[LogprobsEntry | None]:
    """Per row: None, or the sampled token's raw logprob and rank (1 + tokens strictly more
    likely) followed by the top-N tokens with ranks 1..N. logits: [N, V] raw, any float
    dtype (the rows asked for are widened to float32)."""
    entries: list[LogprobsEntry | None] = [None] * len(reqs)
    rows = [i for i, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
    if not rows:
        return entries
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)  # [R, V]
    chosen_ids = torch.tensor([token_ids[i] for i in rows], device=logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, chosen_ids)  # [R, 1]
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    num_top = max(reqs[i].sampling_params.logprobs or 0 for i in rows)
    top_vals, top_ids = torch.topk(logprobs, num_top, dim=-1)  # [R, num_top] each
    chosen_list, top_val_list, top_id_list = (
        chosen.squeeze(1).tolist(),
        top_vals.tolist(),
        top_ids.tolist(),
    )
    for j, i in enumerate(rows):
        entry: LogprobsEntry = {token_ids[i]: Logprob(logprob=chosen_list[j], rank=ranks[j])}
        n = reqs[i].sampling_params.logprobs or 0
        top = zip(top_id_list[j][:n], top_val_list[j][:n], strict=True)
        for rank, (tid, val) in enumerate(top, start=1):
            if tid not in entry:
                entry[tid] = Logprob(logprob=val, rank=rank)
        entries[i] = entry
    return entries
