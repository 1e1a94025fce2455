"""Triton kernel: merge the split-K partial results of ``paged_attention_kernel``.

One program per ``BLOCK_R`` (query row, head) pairs: split ``s`` left an unnormalised
output ``acc_s``, its running max ``m_s`` and sum ``l_s``; the result is
``sum_s w_s acc_s / sum_s w_s l_s`` with ``w_s = exp(m_s - max_s m_s)`` (a split that saw
no visible key has ``m_s = -inf``, weight 0).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_reduce_kernel(
    part_out_ptr,  # [NUM_SPLITS, T, H, d] float32
    part_ml_ptr,  # [NUM_SPLITS, T, H, 2] float32
    out_ptr,  # [T, H, d]
    stride_ot,
    stride_oh,
    num_rows,  # T * H
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (token, head) rows
    s = tl.arange(0, SPLITS_PAD)
    ok = (r < num_rows)[:, None] & (s < NUM_SPLITS)[None, :]  # [BLOCK_R, SPLITS_PAD]
    idx = s[None, :].to(tl.int64) * num_rows + r[:, None]
    m_s = tl.load(part_ml_ptr + idx * 2, mask=ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + idx * 2 + 1, mask=ok, other=0.0)
    m_all = tl.max(m_s, axis=1)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # rows past the end
    w = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m_all[:, None]))
    d = tl.arange(0, D_PAD)
    mask3 = ok[:, :, None] & (d < HEAD_DIM)[None, None, :]
    acc = tl.load(
        part_out_ptr + idx[:, :, None] * HEAD_DIM + d[None, None, :], mask=mask3, other=0.0
    )
    denom = tl.sum(w * l_s, axis=1)
    o = tl.sum(acc * w[:, :, None], axis=1) / tl.where(denom == 0.0, 1.0, denom)[:, None]
    t = r // NUM_HEADS
    h = r % NUM_HEADS
    tl.store(
        out_ptr + (t * stride_ot + h * stride_oh)[:, None] + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=(r < num_rows)[:, None] & (d < HEAD_DIM)[None, :],
    )
