"""Triton kernel: ``hidden += residual`` (optional), then ``out = RMSNorm(hidden) * weight``.

One program per row. The sum is rounded to ``hidden``'s dtype and stored before the norm
reads it back (what ``hidden.add_(residual)`` then the norm give); the norm runs in float32.
``out`` may be ``residual``: a program reads its whole row before it writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(
    hidden_ptr,  # [T, h] updated in place when HAS_RESIDUAL
    residual_ptr,  # [T, h]
    weight_ptr,  # [h]
    out_ptr,  # [T, h]
    stride_h,
    stride_r,
    stride_o,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < HIDDEN
    x = tl.load(hidden_ptr + t * stride_h + i, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + t * stride_r + i, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(hidden_ptr.dtype.element_ty)
        tl.store(hidden_ptr + t * stride_h + i, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / HIDDEN
    w = tl.load(weight_ptr + i, mask=mask, other=0.0).to(tl.float32)
    y = xf * (1.0 / tl.sqrt(var + eps)) * w
    tl.store(out_ptr + t * stride_o + i, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    hidden: torch.Tensor,  # [T, h]
    residual: torch.Tensor | None,  # [T, h]
    weight: torch.Tensor,  # [h]
    eps: float,
    out: torch.Tensor,  # [T, h]
) -> torch.Tensor:
    """Launch ``add_rms_norm_kernel``; returns ``out``."""
    num_rows, size = hidden.shape
    if num_rows == 0:
        return out
    res = residual if residual is not None else hidden
    add_rms_norm_kernel[(num_rows,)](
        hidden,
        res,
        weight,
        out,
        hidden.stride(0),
        res.stride(0),
        out.stride(0),
        eps,
        HIDDEN=size,
        BLOCK=triton.next_power_of_2(size),
        HAS_RESIDUAL=residual is not None,
    )
    return out
