"""Attention with soft-capped scores (Gemma 2): ``cap * tanh(q . k * scale / cap)``.

``torch.nn.functional.scaled_dot_product_attention`` has no soft cap, so ``attend`` spells
the attention out where one is set, in the order transformers' ``eager_attention_forward``
runs it (scores times the scale, divided by the cap, tanh, times the cap, plus the mask,
softmax in float32, back to the dtype, times V), and calls SDPA otherwise.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def attend(
    q: torch.Tensor,  # [..., H, n, d]
    k: torch.Tensor,  # [..., kvh, L, d] (kvh divides H)
    v: torch.Tensor,  # [..., kvh, L, d]
    *,
    attn_mask: torch.Tensor | None = None,  # additive, broadcast to [..., H, n, L]
    is_causal: bool = False,  # query i sees keys [0, i] (n == L)
    scale: float | None = None,  # None: d ** -0.5
    softcap: float | None = None,
    enable_gqa: bool = False,  # as SDPA's: kvh may be fewer than H
) -> torch.Tensor:  # [..., H, n, d]
    """``F.scaled_dot_product_attention`` with these arguments, or, with ``softcap`` set,
    the same attention with soft-capped scores."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., H, n, L]
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        n, length = scores.shape[-2], scores.shape[-1]
        hidden = torch.ones(n, length, dtype=torch.bool, device=q.device).triu_(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    if attn_mask is not None:
        scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
