"""``TritonBackend``: the attention backend of a CUDA device, in Triton kernels.

Per layer and step: ``write_kv`` (one launch: every new token's K/V into its slot,
quantized in the kernel for an int8 / fp8 cache), then ``paged_attention_kernel`` (one
launch for every decode and chunk of the step: no decode groups, no gathered copy, no mask
tensor) and, only when the step splits its keys, ``split_reduce_kernel``. The step's plan
(``plan.build_step_plan``) is built by the first layer and kept in the metadata for the
others. On CPU tensors the kernels run under ``TRITON_INTERPRET=1`` (the tests' path).
"""

from __future__ import annotations

import math

import torch
import triton
from torch._subclasses.fake_tensor import FakeTensor

from kvserve.runtime.attention.interface import AttentionBackend, LayerCache
from kvserve.runtime.attention.metadata import AttentionMetadata
from kvserve.runtime.attention.sdpa import TorchSDPABackend
from kvserve.runtime.attention.triton.kv_write import write_kv
from kvserve.runtime.attention.triton.paged_attention import paged_attention_kernel
from kvserve.runtime.attention.triton.plan import TritonStepPlan, build_step_plan
from kvserve.runtime.attention.triton.split_reduce import split_reduce_kernel
from kvserve.runtime.kv_cache import QuantizedLayerCache

PLAN_KEY = "triton"
REDUCE_ROWS = 16  # (query row, head) pairs per split_reduce program


class TritonBackend(AttentionBackend):
    """Paged attention in Triton kernels: K/V write, one attention launch, split-K merge.

    ``num_splits`` / ``block_m``: fixed launch shapes instead of the plan's heuristics
    (tests reach split-K and multi-tile chunks with them at small sizes).
    """

    name = "triton"

    def __init__(self, *, num_splits: int | None = None, block_m: int | None = None) -> None:
        self.num_splits = num_splits
        self.block_m = block_m

    def plan(
        self, q: torch.Tensor, kv_cache: LayerCache, meta: AttentionMetadata
    ) -> TritonStepPlan:
        """The step's launch plan: built by the first layer, shared by the others."""
        plan = meta.backend_plans.get(PLAN_KEY)
        if not isinstance(plan, TritonStepPlan):
            plan = build_step_plan(
                meta,
                q.shape[1],
                kv_cache.shape[3],
                q.device,
                num_splits=self.num_splits,
                block_m=self.block_m,
            )
            meta.backend_plans[PLAN_KEY] = plan
        return plan

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerCache,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = torch.empty_like(q) if out is None else out
        if isinstance(q, FakeTensor):
            # NOTE: traced by the memory plan: the kernels allocate only the split scratch.
            return out
        if meta.logit_softcap is not None:
            # NOTE: the Triton kernel has no soft cap: a soft-capped layer (Gemma 2) takes
            # TorchSDPABackend's path, which applies it (and reads any cache kind).
            return TorchSDPABackend().forward(q, k, v, kv_cache, meta, out)
        write_kv(kv_cache, meta.slot_mapping, k, v)
        if meta.num_tokens == 0:
            return out
        paged_attention(q, kv_cache, self.plan(q, kv_cache, meta), meta, out)
        return out


def paged_attention(
    q: torch.Tensor,  # [T, H, d]
    kv_cache: LayerCache,
    plan: TritonStepPlan,
    meta: AttentionMetadata,
    out: torch.Tensor,  # [T, H, d]
) -> None:
    """Launch ``paged_attention_kernel`` (and ``split_reduce_kernel`` under split-K)."""
    num_tokens, num_heads, head_dim = q.shape
    quant = isinstance(kv_cache, QuantizedLayerCache)
    data = kv_cache.data if quant else kv_cache
    scales = kv_cache.scales if quant else data
    num_kv_heads, block_size = data.shape[3], data.shape[2]
    if q.stride(2) != 1:
        q = q.contiguous()
    splits = plan.num_splits
    # NOTE: tl.dot needs every dimension >= 16 when compiled (the interpreter does not).
    d_pad = max(16, triton.next_power_of_2(head_dim))
    if splits > 1:
        part_out = torch.empty(
            splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(
            splits, num_tokens, num_heads, 2, dtype=torch.float32, device=q.device
        )
    else:
        part_out = part_ml = out  # unused pointers
    window = meta.sliding_window
    paged_attention_kernel[(plan.num_tiles, num_kv_heads, splits)](
        q,
        out,
        data,
        scales,
        plan.block_table,
        plan.seq_lens,
        plan.query_start,
        plan.tile_seq,
        plan.tile_start,
        part_out,
        part_ml,
        meta.scale if meta.scale is not None else 1.0 / math.sqrt(head_dim),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        data.stride(0),
        scales.stride(0),
        plan.block_table.stride(0),
        num_tokens,
        window if window is not None else 0,
        meta.num_sink_tokens,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=plan.block_m,
        BLOCK_Q=plan.block_q,
        TILE_N=plan.tile_n,
        NUM_SPLITS=splits,
        HAS_WINDOW=window is not None,
        QUANT=quant,
        IS_FP8=quant and kv_cache.kind == "fp8",
        IEEE=q.dtype == torch.float32,
    )
    if splits > 1:
        num_rows = num_tokens * num_heads
        split_reduce_kernel[(triton.cdiv(num_rows, REDUCE_ROWS),)](
            part_out,
            part_ml,
            out,
            out.stride(0),
            out.stride(1),
            num_rows,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            NUM_SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits),
            BLOCK_R=REDUCE_ROWS,
        )
