"""``NativeCPUBackend``: paged attention with the native CPU kernels (see ``__init__``).

Decodes (one query token each) attend straight from the cache blocks with
``kvserve::paged_decode_attention``: no gathered copy of the context, no mask tensor, one
call for the whole batch, split across threads by sequence (by sequence and KV head when
there are fewer than two sequences per thread). New K/V go in with
``kvserve::write_kv``, before any read (the backend invariant). Multi-token chunks attend
as in ``TorchSDPABackend`` (one SDPA call each): a prefill is bound by its weight matmuls.

Where the kernels cannot serve (not loaded, a CUDA cache, a quantized cache) every call
takes ``TorchSDPABackend``'s path, so the backend is safe to select anywhere.
"""

from __future__ import annotations

import math

import torch

from kvserve.runtime import native
from kvserve.runtime.attention import AttentionMetadata, LayerCache, TorchSDPABackend
from kvserve.runtime.kv_cache import QuantizedLayerCache


class NativeCPUBackend(TorchSDPABackend):
    """Native decode attention on CPU; ``TorchSDPABackend`` for chunks and elsewhere."""

    name = "native"

    def forward(
        self,
        q: torch.Tensor,  # [T, H, d]
        k: torch.Tensor,  # [T, kvh, d]
        v: torch.Tensor,  # [T, kvh, d]
        kv_cache: LayerCache,  # [2, num_blocks, block_size, kvh, d]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, d]
        if (
            isinstance(kv_cache, QuantizedLayerCache)
            or kv_cache.device.type != "cpu"
            or not native.available()
        ):
            return super().forward(q, k, v, kv_cache, meta)
        ops = native.ops()
        ops.write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, d]
        nd = meta.num_decode_seqs
        if nd:
            tables, lens = meta.decode_tables
            ops.paged_decode_attention(
                out[:nd],
                q[:nd],
                kv_cache,
                tables,
                lens,
                1.0 / math.sqrt(q.shape[-1]),
                meta.sliding_window or 0,
                meta.num_sink_tokens,
            )
        for c in meta.chunks:
            rows = slice(c.token_offset, c.token_offset + c.num_query_tokens)
            out[rows] = self._chunk(q[rows], k[rows], v[rows], kv_cache, c)
        return out
