"""Triton kernel: rotate-half RoPE (HF layout) in place on ``x`` [T, n, d].

``cos`` / ``sin`` are the model's tables (``rope_cos_sin``: sin sign-folded), so element
``i`` becomes ``x[i] * cos[i] + x[(i + d/2) % d] * sin[i]``, as ``layer_ops.rope_views_``
computes. One program per token: all ``n`` heads of the row at once, read before written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rope_kernel(
    x_ptr,  # [T, n, d] (strided rows, contiguous heads)
    cos_ptr,  # [T, 1, d]
    sin_ptr,  # [T, 1, d]
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    N_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, N_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    row = x_ptr + t * stride_xt + h[:, None] * stride_xh
    x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    swapped = (d + HEAD_DIM // 2) % HEAD_DIM
    xs = tl.load(row + swapped[None, :], mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_ct + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    y = x * c[None, :] + xs * s[None, :]
    tl.store(row + d[None, :], y.to(x_ptr.dtype.element_ty), mask=mask)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Launch ``rope_kernel`` on ``x`` [T, n, d] in place; returns ``x``."""
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens == 0:
        return x
    if x.stride(2) != 1 or cos.stride(2) != 1 or sin.stride(2) != 1:
        raise ValueError("rope_: the last dimension of x, cos and sin must be contiguous")
    rope_kernel[(num_tokens,)](
        x,
        cos,
        sin,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        N_PAD=triton.next_power_of_2(num_heads),
        D_PAD=triton.next_power_of_2(head_dim),
    )
    return x
