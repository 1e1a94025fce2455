"""``TorchReferenceBackend``: exact and simple paged attention.

Per sequence it computes slots from the block table in Python, gathers K/V token by token
and runs explicit masked softmax attention: the reference every other backend equals up to
float summation order.
"""

from __future__ import annotations

import math

import torch

from kvserve.runtime.attention.interface import AttentionBackend, LayerCache
from kvserve.runtime.attention.metadata import AttentionMetadata, readable_table, visible_mask
from kvserve.runtime.kv_cache import QuantizedLayerCache, dequantize_kv, quantize_kv


class TorchReferenceBackend(AttentionBackend):
    """Exact, simple paged attention: Python block-table lookups, explicit softmax."""

    name = "torch_ref"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerCache,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bs = meta.block_size
        device = kv_cache.device
        num_heads, head_dim = q.shape[1], q.shape[2]
        group = num_heads // k.shape[1]
        # 1) write every new token of every sequence.
        for s in meta.seqs:
            pos = range(s.start_pos, s.seq_len)
            blk = torch.tensor([s.block_ids[p // bs] for p in pos], device=device)
            off = torch.tensor([p % bs for p in pos], device=device)
            rows = slice(s.token_offset, s.token_offset + s.num_query_tokens)
            _write_tokens(kv_cache, blk, off, k[rows], v[rows])
        # 2) attend, reading K/V back through the block tables.
        out = torch.empty_like(q) if out is None else out
        scale = meta.scale if meta.scale is not None else 1.0 / math.sqrt(head_dim)
        cap = meta.logit_softcap
        for s in meta.seqs:
            pos = range(s.seq_len)
            table = readable_table(s.block_ids)
            blk = torch.tensor([table[p // bs] for p in pos], device=device)
            off = torch.tensor([p % bs for p in pos], device=device)
            keys, values = _read_tokens(kv_cache, blk, off, q.dtype)  # [L, kvh, d] each
            keys = keys.repeat_interleave(group, dim=1)  # [L, H, d]
            values = values.repeat_interleave(group, dim=1)  # [L, H, d]
            rows = slice(s.token_offset, s.token_offset + s.num_query_tokens)
            scores = torch.einsum("qhd,khd->hqk", q[rows], keys) * scale  # [H, n, L]
            if cap is not None:  # Gemma 2's soft cap, as transformers applies it
                scores = torch.tanh(scores / cap) * cap
            q_pos = torch.arange(s.start_pos, s.seq_len, device=device)[:, None]
            k_pos = torch.arange(s.seq_len, device=device)[None, :]
            allowed = visible_mask(q_pos, k_pos, meta.sliding_window, meta.num_sink_tokens)
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[rows] = torch.einsum("hqk,khd->qhd", probs, values)
        return out


def _write_tokens(
    kv_cache: LayerCache,
    blk: torch.Tensor,  # [n] long
    off: torch.Tensor,  # [n] long
    k: torch.Tensor,  # [n, kvh, d]
    v: torch.Tensor,  # [n, kvh, d]
) -> None:
    """Reference write: token i goes to block ``blk[i]`` offset ``off[i]`` (quantized if so)."""
    if isinstance(kv_cache, QuantizedLayerCache):
        for i, x in ((0, k), (1, v)):
            data, scales = quantize_kv(x, kv_cache.kind)
            kv_cache.data[i, blk, off] = data
            kv_cache.scales[i, blk, off] = scales
        return
    kv_cache[0, blk, off] = k
    kv_cache[1, blk, off] = v


def _read_tokens(
    kv_cache: LayerCache, blk: torch.Tensor, off: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference read of K and V ``[n, kvh, d]`` at (block, offset) pairs, dequantized."""
    if isinstance(kv_cache, QuantizedLayerCache):
        kind = kv_cache.kind
        data, scales = kv_cache.data, kv_cache.scales
        return (
            dequantize_kv(data[0, blk, off], scales[0, blk, off], kind, dtype),
            dequantize_kv(data[1, blk, off], scales[1, blk, off], kind, dtype),
        )
    return kv_cache[0, blk, off], kv_cache[1, blk, off]
