"""``NativeCPUBackend``: paged attention with the native CPU kernels (see ``__init__``).

Decodes (one query token each) attend straight from the cache blocks with
``kvserve::paged_decode_attention``: no gathered copy of the context, no mask tensor, one
call for the whole batch, split across threads by sequence (by sequence and KV head when
there are fewer than two sequences per thread). New K/V go in with
``kvserve::write_kv``, before any read (the backend invariant). A multi-token chunk of at
most ``chunk_kernel_max_tokens`` rows runs through the same kernel, each row a decode query
of its own causal length (``AttentionMetadata.query_tables``); a longer one attends as in
``TorchSDPABackend`` (one SDPA call). The engine sets the limit at start-up where the kernel
measured faster (``chunk_limit.chunk_attention_limit``).

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
    """Native decode (and short-chunk) attention on CPU; ``TorchSDPABackend`` elsewhere."""

    name = "native"

    def __init__(self, chunk_kernel_max_tokens: int = 0, chunk_sdpa_float32: bool = False) -> None:
        """``chunk_kernel_max_tokens``: a chunk of at most this many query tokens attends
        through the decode kernel, one query row at a time (its context read in place, no
        gathered copy, no mask), a longer one through SDPA; ``chunk_sdpa_float32``: that SDPA
        runs in float32 for a half-precision model (``chunk_limit.chunk_attention_limit``
        measures both choices on this CPU)."""
        if chunk_kernel_max_tokens < 0:
            raise ValueError(f"chunk_kernel_max_tokens must be >= 0, got {chunk_kernel_max_tokens}")
        self.chunk_kernel_max_tokens = chunk_kernel_max_tokens
        self.chunk_sdpa_float32 = chunk_sdpa_float32

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
        window, sinks = meta.sliding_window or 0, meta.num_sink_tokens
        scale = 1.0 / math.sqrt(q.shape[-1])
        # NOTE: rows [0, end) run as decode queries in one call: the decodes and then every
        # chunk up to the first one too long for the kernel (chunk_kernel_max_tokens).
        end, lead = meta.num_decode_seqs, 0
        while lead < len(meta.chunks) and (
            meta.chunks[lead].num_query_tokens <= self.chunk_kernel_max_tokens
        ):
            end = meta.chunks[lead].token_offset + meta.chunks[lead].num_query_tokens
            lead += 1
        rest = meta.chunks[lead:]
        if end:
            if end == meta.num_decode_seqs:
                tables, lens = meta.decode_tables
            else:
                tables, lens = meta.query_tables
                tables, lens = tables[:end], lens[:end]
            ops.paged_decode_attention(
                out[:end], q[:end], kv_cache, tables, lens, scale, window, sinks
            )
        for c in rest:
            rows = slice(c.token_offset, c.token_offset + c.num_query_tokens)
            if c.num_query_tokens <= self.chunk_kernel_max_tokens:
                tables, lens = meta.query_tables
                ops.paged_decode_attention(
                    out[rows], q[rows], kv_cache, tables[rows], lens[rows], scale, window, sinks
                )
            else:
                compute = torch.float32 if self.chunk_sdpa_float32 else None
                out[rows] = self._chunk(q[rows], k[rows], v[rows], kv_cache, c, compute)
        return out
