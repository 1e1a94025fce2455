"""What edits the logits of the sampled rows before the draw: penalties, then temperature,
min-p, top-k and top-p (``Sampler`` applies them in that order).

``apply_penalties`` works in place on the touched (row, token) pairs only; ``truncated_probs``
returns the probabilities to draw from, over the candidate tokens only when every row is
truncated.
"""

from __future__ import annotations

import math

import torch

from kvserve.core.outputs import ScheduledRequest
from kvserve.sampling_params import SamplingParams

__all__ = ["apply_penalties", "truncated_probs"]

# Top-p first looks for the nucleus among this many most likely tokens (a top-k, cheap); only
# the rows whose mass falls short of top_p search again among _TOP_P_WIDEN times as many,
# and the whole vocabulary is sorted only for rows that still fall short.
# NOTE: most rows find their nucleus among 256 candidates and almost all among 4096, and a
# wide topk costs far more than a narrow one, so only the rows that fall short widen (the
# measurements: bench/README.md, "Measurements behind constants in the code").
_TOP_P_CANDIDATES = 256
_TOP_P_WIDEN = 16


# ------------------------------------------------------------------------------ penalties
def apply_penalties(logits: torch.Tensor, reqs: list[ScheduledRequest]) -> torch.Tensor:
    """Apply each row's penalties to ``logits`` [N, V] in place (and return it).

    Repetition penalty (HF): over the set of prompt + output tokens, positive logits are
    divided by it and negative ones multiplied. Then presence / frequency penalties (OpenAI):
    over output tokens, ``logit -= presence * [count > 0] + frequency * count``.
    Works on the touched (row, token) pairs only: O(tokens), not O(N * V).
    """
    if not logits.is_contiguous():
        raise ValueError("apply_penalties: logits must be contiguous (it edits a flat view)")
    vocab = logits.shape[1]
    flat = logits.view(-1)  # [N * V]
    rep_keys: list[int] = []
    out_keys: list[int] = []
    for row, req in enumerate(reqs):
        p = req.sampling_params
        base = row * vocab
        if p.repetition_penalty != 1.0:
            rep_keys.extend(base + t for t in req.prompt_token_ids)
            rep_keys.extend(base + t for t in req.output_token_ids)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            out_keys.extend(base + t for t in req.output_token_ids)
    device = logits.device
    if rep_keys:
        keys = torch.unique(torch.tensor(rep_keys, dtype=torch.long, device=device))  # [K]
        rep = _column([r.sampling_params.repetition_penalty for r in reqs], logits).flatten()
        factor = rep[keys // vocab]  # [K]
        vals = flat[keys]
        flat[keys] = torch.where(vals > 0, vals / factor, vals * factor)
    if out_keys:
        keys, counts = torch.unique(
            torch.tensor(out_keys, dtype=torch.long, device=device), return_counts=True
        )  # [K] each
        rows = keys // vocab
        presence = _column([r.sampling_params.presence_penalty for r in reqs], logits).flatten()
        frequency = _column([r.sampling_params.frequency_penalty for r in reqs], logits).flatten()
        flat[keys] -= frequency[rows] * counts.to(logits.dtype) + presence[rows]
    return logits


# ----------------------------------------------------------------------------- truncation
def truncated_probs(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature, then min-p, top-k and top-p masks. Returns (probs [M, V], None), or
    (probs [M, C], token ids [M, C]) over candidate tokens when every row is truncated."""
    vocab = logits.shape[1]
    logits = logits / _column([p.temperature for p in params], logits)  # [M, V]
    if any(p.min_p > 0.0 for p in params):
        # prob_i >= min_p * prob_max  <=>  logit_i >= logit_max + log(min_p)
        log_min_p = [math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in params]
        threshold = logits.amax(dim=-1, keepdim=True) + _column(log_min_p, logits)  # [M, 1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    # NOTE: top_k -1 or 0 (off) and any top_k >= the vocabulary keep the whole row (vLLM
    # clips top_k to the vocabulary).
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    rows = [j for j in range(len(params)) if top_ks[j] < vocab or top_ps[j] < 1.0]
    if len(rows) == len(params):
        # NOTE: every row is truncated, so sample among the candidates only and skip the
        # vocabulary-wide scatter, softmax and cumsum.
        vals, idx = _top_k_top_p_candidates(logits, top_ks, top_ps)  # [M, C] each
        return torch.softmax(vals, dim=-1), idx
    if rows:
        logits[rows] = _top_k_top_p(
            logits[rows], [top_ks[j] for j in rows], [top_ps[j] for j in rows]
        )
    return torch.softmax(logits, dim=-1), None


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """``logits`` [M, V] with the tokens dropped by top-k / top-p set to -inf."""
    vocab = logits.shape[1]
    vals, idx = _top_k_top_p_candidates(logits, top_ks, top_ps)  # [M, C] each
    # NOTE: one spare column receives the padding entries (id ``vocab``), then is cut off.
    out = logits.new_full((logits.shape[0], vocab + 1), float("-inf"))  # [M, V + 1]
    return out.scatter_(1, idx, vals)[:, :vocab]


def _top_k_top_p_candidates(
    logits: torch.Tensor,
    top_ks: list[int],
    top_ps: list[float],
    num_cand: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each row's top-k tokens, then the nucleus (smallest most-likely set with mass
    >= top_p, renormalised over the top-k set, as vLLM). logits: [M, V].

    Returns (candidate logits [M, C] with dropped ones at -inf, their token ids [M, C]),
    C >= every kept set. Rows whose nucleus does not fit in the first ``num_cand`` candidates
    are searched again, alone, among ``_TOP_P_WIDEN`` times as many (or the whole row when
    that provably cannot hold it); the other rows are padded to the widest C with logit -inf
    and id ``V`` (never sampled).
    """
    vocab = logits.shape[1]
    if num_cand is None:
        num_cand = min(vocab, max([_TOP_P_CANDIDATES] + [k for k in top_ks if k < vocab]))
    vals, idx, min_need = _nucleus_among(logits, top_ks, top_ps, num_cand)
    if num_cand == vocab:
        return vals, idx
    wider = min(vocab, num_cand * _TOP_P_WIDEN)
    by_width: dict[int, list[int]] = {}  # rows to search again, by their next width
    for row, need in enumerate(min_need.tolist()):
        if need > 0:
            by_width.setdefault(vocab if need > wider else wider, []).append(row)
    if not by_width:
        return vals, idx
    if len(by_width) == 1 and len(next(iter(by_width.values()))) == len(top_ks):
        # Every row goes to the same width: search them all again, nothing to merge.
        return _top_k_top_p_candidates(logits, top_ks, top_ps, num_cand=next(iter(by_width)))
    found = []  # per group: rows, [W, C'] logits, [W, C'] ids
    for width, rows in by_width.items():
        ks, ps = [top_ks[r] for r in rows], [top_ps[r] for r in rows]
        found.append((rows, *_top_k_top_p_candidates(logits[rows], ks, ps, num_cand=width)))
    pad = max(wide_vals.shape[1] for _, wide_vals, _ in found) - num_cand
    vals = torch.nn.functional.pad(vals, (0, pad), value=float("-inf"))  # [M, C']
    idx = torch.nn.functional.pad(idx, (0, pad), value=vocab)
    for rows, wide_vals, wide_idx in found:
        vals[rows, : wide_vals.shape[1]] = wide_vals
        idx[rows, : wide_idx.shape[1]] = wide_idx
    return vals, idx


def _nucleus_among(
    logits: torch.Tensor, top_ks: list[int], top_ps: list[float], num_cand: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k then top-p among each row's ``num_cand`` most likely tokens. logits: [M, V].

    Returns (candidate logits [M, C] with dropped ones at -inf, their ids [M, C], min_need
    [M]): min_need is 0 for rows whose kept set lies inside the candidates, else a lower
    bound on the candidates their nucleus needs (inf when the last candidate has p == 0).
    """
    vocab = logits.shape[1]
    k_col = torch.tensor(top_ks, device=logits.device).unsqueeze(1)  # [M, 1]
    has_k = k_col < vocab  # [M, 1]
    p_col = _column(top_ps, logits)  # [M, 1]
    vals, idx = torch.topk(logits, num_cand, dim=-1)  # [M, C] each, descending
    positions = torch.arange(num_cand, device=logits.device).unsqueeze(0)  # [1, C]
    vals = vals.masked_fill(positions >= k_col, float("-inf"))
    log_norm = torch.logsumexp(vals, dim=-1, keepdim=True)  # [M, 1]
    if not bool(has_k.all()):
        # Top-p renormalises over the kept top-k set; rows without top-k over the whole row.
        row_log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)  # [M, 1]
        log_norm = torch.where(has_k, log_norm, row_log_norm)
    probs = torch.exp(vals - log_norm)  # [M, C]
    cum = probs.cumsum(dim=-1)
    # Keep token i while the mass strictly before it is below top_p; always keep the first.
    drop = (cum - probs) >= p_col
    drop[:, 0] = False
    # Rows with top-k are always covered (num_cand >= k); the others once the mass reaches p.
    covered = has_k | (cum[:, -1:] >= p_col)  # [M, 1]
    # NOTE: no token past the candidates is more likely than the last one, so a short row
    # needs at least this many; the caller skips widths that provably cannot hold it.
    min_need = num_cand + (p_col - cum[:, -1:]) / probs[:, -1:]  # [M, 1]
    min_need = min_need.masked_fill(covered, 0.0).squeeze(1)  # [M]
    return vals.masked_fill(drop, float("-inf")), idx, min_need


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """A [M, 1] tensor of per-row values, matching ``like``'s dtype and device."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)
