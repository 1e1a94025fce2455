"""``NativeCPUBackend``: paged attention with the native CPU kernels (``kvserve.runtime.native``).

Decodes (one query token each) attend straight from the cache blocks with
``kvserve::paged_decode_attention``: no gathered copy of the context, no mask tensor, one
call for the whole batch, split across threads by sequence (by sequence and KV head when
there are fewer than two sequences per thread). New K/V go in with
``kvserve::write_kv``, before any read (the backend invariant). A multi-token chunk of at
most ``chunk_kernel_max_tokens`` rows runs through the same kernel, each row a decode query
of its own causal length (``AttentionMetadata.query_tables``); a longer one attends as in
``TorchSDPABackend`` (one SDPA call) or, on an AMX CPU, through ``kvserve::amx_prefill_attention``
(bf16, head_dim 64, no sliding window: flash attention on AMX tiles over the paged cache). The
engine sets the limit and the way longer chunks go at start-up, where each measured faster
(``runtime/native/chunk_limit.chunk_attention_limit``).

Where the kernels cannot serve (not loaded, a CUDA cache, a quantized cache, soft-capped
scores) every call takes ``TorchSDPABackend``'s path, so the backend is safe to select anywhere.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kvserve.runtime import native
from kvserve.runtime.attention.interface import LayerCache
from kvserve.runtime.attention.metadata import AttentionMetadata, ChunkMeta
from kvserve.runtime.attention.sdpa import TorchSDPABackend
from kvserve.runtime.kv_cache import QuantizedLayerCache

# The one head size kvserve::amx_prefill_attention serves (its O^T takes four of the 8 tiles).
AMX_PREFILL_HEAD_DIM = 64


@functools.cache
def amx_prefill_available() -> bool:
    """Whether ``kvserve::amx_prefill_attention`` runs here: the native kernels loaded, built
    with AMX-BF16, and the tile state granted to this process."""
    return native.available() and bool(
        native.ops().amx_prefill_supported(AMX_PREFILL_HEAD_DIM)  # type: ignore[attr-defined]
    )


class NativeCPUBackend(TorchSDPABackend):
    """Native decode (and short-chunk) attention on CPU; ``TorchSDPABackend`` elsewhere."""

    name = "native"

    def __init__(
        self,
        chunk_kernel_max_tokens: int = 0,
        chunk_sdpa_float32: bool = False,
        chunk_amx: bool = False,
    ) -> None:
        """``chunk_kernel_max_tokens``: a chunk of at most this many query tokens attends
        through the decode kernel, one query row at a time (its context read in place, no
        gathered copy, no mask), a longer one through SDPA; ``chunk_sdpa_float32``: that SDPA
        runs in float32 for a half-precision model; ``chunk_amx``: longer chunks run
        ``kvserve::amx_prefill_attention`` instead, where it serves them (``amx_serves``),
        SDPA where not (``chunk_limit.chunk_attention_limit`` measures the choices on this
        CPU)."""
        if chunk_kernel_max_tokens < 0:
            raise ValueError(f"chunk_kernel_max_tokens must be >= 0, got {chunk_kernel_max_tokens}")
        self.chunk_kernel_max_tokens = chunk_kernel_max_tokens
        self.chunk_sdpa_float32 = chunk_sdpa_float32
        self.chunk_amx = chunk_amx

    def forward(
        self,
        q: torch.Tensor,  # [T, H, d]
        k: torch.Tensor,  # [T, kvh, d]
        v: torch.Tensor,  # [T, kvh, d]
        kv_cache: LayerCache,  # [2, num_blocks, block_size, kvh, d]
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,  # [T, H, d] scratch
    ) -> torch.Tensor:  # [T, H, d]
        if meta.logit_softcap is not None or not self.kernels_serve(kv_cache):
            # NOTE: the native kernels have no soft cap: a soft-capped layer (Gemma 2) takes
            # TorchSDPABackend's path, which applies it.
            return super().forward(q, k, v, kv_cache, meta, out)
        limit = self.chunk_kernel_max_tokens
        plan = self.kernel_rows(meta)
        ops = native.ops()
        ops.write_kv(kv_cache, k, v, meta.slot_mapping)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, d]
        scale = meta.scale if meta.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        window, sinks = meta.sliding_window or 0, meta.num_sink_tokens
        if plan.end:
            tables, lens = plan.tables, plan.lens
            # NOTE: no views when the call covers every row (a decode-only step): at B=1 the
            # two slices were ~4 us of a ~30 us layer call (the Xeon without AMX, 2026-12-03,
            # 02cba92).
            whole = plan.end == q.shape[0]
            ops.paged_decode_attention(
                out if whole else out[: plan.end],
                q if whole else q[: plan.end],
                kv_cache,
                tables,
                lens,
                scale,
                window,
                sinks,
            )
        # The rest chunks' block tables where they go through the AMX kernel, else None.
        amx_tables = (
            plan.rest_tables if self.chunk_amx and self.amx_serves(q, kv_cache, meta) else None
        )
        for i, c in enumerate(plan.rest):
            rows = slice(c.token_offset, c.token_offset + c.num_query_tokens)
            if c.num_query_tokens <= limit:
                tables, lens = meta.query_tables
                ops.paged_decode_attention(
                    out[rows], q[rows], kv_cache, tables[rows], lens[rows], scale, window, sinks
                )
            elif amx_tables is not None:
                ops.amx_prefill_attention(
                    out[rows], q[rows], kv_cache, amx_tables[i], c.start_pos, scale
                )
            else:
                compute = torch.float32 if self.chunk_sdpa_float32 else None
                out[rows] = self._chunk(q[rows], k[rows], v[rows], kv_cache, c, compute, meta.scale)
        return out

    @staticmethod
    def kernels_serve(kv_cache: LayerCache) -> bool:
        """Whether the native kernels can read and write ``kv_cache`` (an unquantized CPU
        cache, the kernels loaded); where not, every call takes the SDPA path."""
        return (
            not isinstance(kv_cache, QuantizedLayerCache) and kv_cache.is_cpu and native.available()
        )

    @staticmethod
    def amx_serves(q: torch.Tensor, kv_cache: LayerCache, meta: AttentionMetadata) -> bool:
        """Whether ``kvserve::amx_prefill_attention`` can attend this step's long chunks: a
        bf16 model and cache of head_dim 64, no sliding window, the kernel available."""
        return (
            q.dtype == torch.bfloat16
            and kv_cache.dtype == torch.bfloat16
            and q.shape[-1] == AMX_PREFILL_HEAD_DIM
            and not meta.sliding_window
            and not meta.num_sink_tokens
            and amx_prefill_available()
        )

    def kernel_rows(self, meta: AttentionMetadata) -> _KernelRows:
        """Which rows of ``meta``'s step run through the kernel (made once a step)."""
        limit, amx = self.chunk_kernel_max_tokens, self.chunk_amx
        plan = meta.backend_plans.get(self.name)
        if (
            not isinstance(plan, _KernelRows)
            or plan.limit != limit
            or (amx and plan.rest_tables is None)
        ):
            plan = meta.backend_plans[self.name] = _KernelRows.of(meta, limit, with_tables=amx)
        return plan

    def whole_step_tables(
        self, meta: AttentionMetadata, kv_cache: LayerCache
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The block tables ``[T, max_blocks]`` and lengths ``[T]`` (int32) of a step whose
        every query row runs through ``paged_decode_attention`` on ``kv_cache``'s kind of
        cache, as ``forward`` would run it; None when some row would not (a long chunk, a
        quantized or non-CPU cache, no kernels)."""
        if meta.logit_softcap is not None or not self.kernels_serve(kv_cache):
            return None
        plan = self.kernel_rows(meta)
        if plan.rest or plan.end != meta.num_tokens or plan.tables is None or plan.lens is None:
            return None
        return plan.tables, plan.lens


@dataclass(frozen=True, slots=True)
class _KernelRows:
    """What every layer of a step reads the same way: made by the first, kept on the metadata.

    Rows ``[0, end)`` run as decode queries in one kernel call (``tables``, ``lens``): the
    decodes and then every chunk up to the first one too long for the kernel (``limit``);
    ``rest`` are the chunks after it, ``rest_tables`` their sequences' block tables (for the AMX
    prefill kernel; None unless asked for, so that a step that will not use them builds none).
    """

    limit: int
    end: int
    tables: torch.Tensor | None  # [end, max_blocks] int32
    lens: torch.Tensor | None  # [end] int32
    rest: tuple[ChunkMeta, ...]
    rest_tables: tuple[torch.Tensor, ...] | None  # each rest chunk's block table, int32

    @classmethod
    def of(cls, meta: AttentionMetadata, limit: int, *, with_tables: bool = False) -> _KernelRows:
        """The plan of ``meta`` under a chunk limit of ``limit`` query tokens (with the rest
        chunks' block tables when ``with_tables``)."""
        end, lead = meta.num_decode_seqs, 0
        while lead < len(meta.chunks) and meta.chunks[lead].num_query_tokens <= limit:
            end = meta.chunks[lead].token_offset + meta.chunks[lead].num_query_tokens
            lead += 1
        tables = lens = None
        if end == meta.num_decode_seqs and end:
            tables, lens = meta.decode_tables
        elif end:
            tables, lens = meta.query_tables
            tables, lens = tables[:end], lens[:end]
        rest = tuple(meta.chunks[lead:])
        rest_tables = None
        if with_tables:
            blocks = {s.token_offset: s.block_ids for s in meta.seqs}
            device = meta.slot_mapping.device
            rest_tables = tuple(
                torch.tensor(blocks[c.token_offset], dtype=torch.int32, device=device) for c in rest
            )
        return cls(limit, end, tables, lens, rest, rest_tables)
