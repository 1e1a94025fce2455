"""Triton kernel: write the step's new K/V into their cache slots (quantized if the cache is).

One program takes ``BLOCK_R`` (new token, KV head) rows and writes each one's K and V row of
``head_dim`` elements into slot ``slot_mapping[t]`` of the layer cache
``[2, num_blocks, block_size, kvh, d]``. A negative slot is skipped (a padded row). For an
int8 / fp8 cache the row is quantized in the kernel exactly as ``kv_cache.quantize_kv`` does
and its scale stored beside it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.runtime.attention.triton.quant import (
    FP8_E4M3_MAX,
    INT8_MAX,
    MIN_SCALE,
    fp8_e4m3_bits,
    round_half_even,
)
from kvserve.runtime.kv_cache import QuantizedLayerCache

BLOCK_R = 16  # (token, KV head) rows per program


@triton.jit
def _store_rows(
    x,  # [BLOCK_R, D_PAD]
    dst,  # [BLOCK_R, D_PAD] pointers
    scale_dst,  # [BLOCK_R] pointers
    mask,  # [BLOCK_R, D_PAD]
    row_ok,  # [BLOCK_R]
    QUANT: tl.constexpr,
    IS_FP8: tl.constexpr,
    QMAX: tl.constexpr,
):
    if QUANT:
        xf = x.to(tl.float32)
        amax = tl.max(tl.where(mask, tl.abs(xf), 0.0), axis=1)
        scale = tl.maximum(tl.math.div_rn(amax, QMAX), MIN_SCALE)
        y = tl.math.div_rn(xf, scale[:, None])
        if IS_FP8:
            y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
            tl.store(dst, fp8_e4m3_bits(y), mask=mask)
        else:
            y = tl.minimum(tl.maximum(round_half_even(y), -QMAX), QMAX)
            tl.store(dst, y.to(tl.int8), mask=mask)
        tl.store(scale_dst, scale, mask=row_ok)
    else:
        tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _kv_write_kernel(
    k_ptr,  # [T, kvh, d]
    v_ptr,  # [T, kvh, d]
    slot_ptr,  # [T] int64
    cache_ptr,  # [2, num_blocks * block_size, kvh, d] (bytes when quantized)
    scale_ptr,  # [2, num_blocks * block_size, kvh] float32 (quantized only)
    num_rows,  # T * kvh
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    plane,  # elements between the K and V halves of the cache
    scale_plane,  # the same for the scales
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    QUANT: tl.constexpr,
    IS_FP8: tl.constexpr,
    QMAX: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (token, head) rows
    t = r // NUM_KV_HEADS
    h = r % NUM_KV_HEADS
    slot = tl.load(slot_ptr + t, mask=r < num_rows, other=-1)
    row_ok = slot >= 0
    d = tl.arange(0, D_PAD)
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + (t * stride_kt + h * stride_kh)[:, None] + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + (t * stride_vt + h * stride_vh)[:, None] + d[None, :], mask=mask, other=0.0)
    srow = slot * NUM_KV_HEADS + h
    dst = cache_ptr + srow[:, None] * HEAD_DIM + d[None, :]
    _store_rows(k, dst, scale_ptr + srow, mask, row_ok, QUANT, IS_FP8, QMAX)
    _store_rows(v, dst + plane, scale_ptr + scale_plane + srow, mask, row_ok, QUANT, IS_FP8, QMAX)


def write_kv(
    kv_cache: torch.Tensor | QuantizedLayerCache,
    slot_mapping: torch.Tensor,  # [T] long; < 0: skip the row
    k: torch.Tensor,  # [T, kvh, d]
    v: torch.Tensor,  # [T, kvh, d]
) -> None:
    """Write (quantizing for an int8 / fp8 cache) every row of ``k``/``v`` into its slot."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    quant = isinstance(kv_cache, QuantizedLayerCache)
    data = kv_cache.data if quant else kv_cache
    scales = kv_cache.scales if quant else data  # an unused pointer when not quantized
    if k.stride(2) != 1 or v.stride(2) != 1:
        k, v = k.contiguous(), v.contiguous()
    is_fp8 = quant and kv_cache.kind == "fp8"
    num_rows = num_tokens * num_kv_heads
    _kv_write_kernel[(triton.cdiv(num_rows, BLOCK_R),)](
        k,
        v,
        slot_mapping,
        data,
        scales,
        num_rows,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        data.stride(0),
        scales.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_R=BLOCK_R,
        QUANT=quant,
        IS_FP8=is_fp8,
        QMAX=FP8_E4M3_MAX if is_fp8 else INT8_MAX,
    )
