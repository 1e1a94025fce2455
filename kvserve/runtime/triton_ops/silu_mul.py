"""Triton kernel: ``out = SiLU(gate) * up`` over the halves of ``gate_up`` [T, 2I].

One program per ``BLOCK`` columns of a row, in float32, rounded once to ``out``'s dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def silu_mul_kernel(
    gate_up_ptr,  # [T, 2I]
    out_ptr,  # [T, I]
    stride_g,
    stride_o,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < INTER
    g = tl.load(gate_up_ptr + t * stride_g + i, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + t * stride_g + INTER + i, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + t * stride_o + i, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Launch ``silu_mul_kernel``: ``gate_up`` [T, 2I] -> ``out`` [T, I]; returns ``out``."""
    num_rows, inter = out.shape
    if num_rows == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(inter))
    silu_mul_kernel[(num_rows, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), INTER=inter, BLOCK=block
    )
    return out
