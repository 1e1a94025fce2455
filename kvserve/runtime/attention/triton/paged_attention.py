"""Triton kernel: paged attention for a whole step (decodes and prefill chunks) in one launch.

Grid ``(query tiles, KV heads, key splits)`` (tiles from ``plan.build_step_plan``). A program
holds ``BLOCK_Q`` query rows of one sequence times the ``GROUP`` query heads that share one
KV head (GQA: ``BLOCK_M = BLOCK_Q * GROUP`` rows, each K/V tile loaded once for all of
them) and walks the sequence's keys ``TILE_N`` at a time, reading them in place through the
block table: key position ``p`` sits in block ``table[p // BLOCK_SIZE]`` at offset
``p % BLOCK_SIZE`` (any block size; a freed ``NULL_BLOCK_ID`` entry reads block 0, masked).
Online softmax in float32 (flash attention).

Visibility is the package's (``metadata.visible_mask``): causal within the chunk, full over
the history before it, and with a window W and S sinks only keys ``k > p - W`` or ``k < S``.
With a window the program visits two key ranges: the sinks ``[0, min(S, lo))`` and the
window ``[lo, end)`` where ``lo`` is the first key its first row can see, so a long
windowed context costs its window, not its length.

Split-K (``NUM_SPLITS > 1``): program ``s`` takes the ``s``-th slice of the tile's key tiles
and writes its unnormalised output, running max and sum to scratch; ``split_reduce`` merges.

int8 / fp8 caches are dequantised in the kernel, token by token with their scales, to the
query's dtype (what ``dequantize_kv`` gives the torch backends).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_attention_kernel(
    q_ptr,  # [T, H, d]
    out_ptr,  # [T, H, d]
    cache_ptr,  # layer cache [2, num_blocks, block_size, kvh, d] (bytes when quantized)
    scale_ptr,  # [2, num_blocks, block_size, kvh] float32 (quantized only)
    table_ptr,  # [S, W] int32
    seq_lens_ptr,  # [S] int32
    query_start_ptr,  # [S + 1] int32
    tile_seq_ptr,  # [P] int32
    tile_start_ptr,  # [P] int32
    part_out_ptr,  # [NUM_SPLITS, T, H, d] float32 (split-K only)
    part_ml_ptr,  # [NUM_SPLITS, T, H, 2] float32: running max, sum (split-K only)
    sm_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    plane,  # elements between the K and V halves of the cache
    scale_plane,
    table_stride,
    num_tokens,
    window,
    sinks,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    QUANT: tl.constexpr,
    IS_FP8: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    row0 = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(query_start_ptr + seq)
    q_end = tl.load(query_start_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    start_pos = seq_len - (q_end - q_begin)

    m = tl.arange(0, BLOCK_M)
    qi = m // GROUP
    head = kvh * GROUP + m % GROUP
    tok = row0 + qi
    row_ok = (qi < BLOCK_Q) & (tok < q_end)
    q_pos = start_pos + tok - q_begin
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & dmask[None, :],
        other=0.0,
    )

    # The key ranges this tile's rows can see: [0, sink_hi) and [win_lo, kv_len).
    kv_len = start_pos + tl.minimum(row0 + BLOCK_Q, q_end) - q_begin
    if HAS_WINDOW:
        win_lo = tl.maximum(start_pos + row0 - q_begin - window + 1, 0)
        sink_hi = tl.minimum(sinks, win_lo)
    else:
        win_lo = kv_len * 0
        sink_hi = kv_len * 0
    n_sink_tiles = (sink_hi + TILE_N - 1) // TILE_N
    win_tile0 = win_lo // TILE_N
    n_tiles = n_sink_tiles + (kv_len + TILE_N - 1) // TILE_N - win_tile0
    per_split = (n_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    for j in range(lo, hi):
        in_sink = j < n_sink_tiles
        start = tl.where(in_sink, j, win_tile0 + j - n_sink_tiles) * TILE_N
        r_lo = tl.where(in_sink, 0, win_lo)
        r_hi = tl.where(in_sink, sink_hi, kv_len)
        kp = start + offs_n
        k_ok = (kp >= r_lo) & (kp < r_hi)
        blk = tl.load(table_ptr + seq * table_stride + kp // BLOCK_SIZE, mask=k_ok, other=0)
        slot = tl.maximum(blk, 0).to(tl.int64) * BLOCK_SIZE + kp % BLOCK_SIZE
        row = slot * NUM_KV_HEADS + kvh
        k_t = tl.load(
            cache_ptr + row[None, :] * HEAD_DIM + d[:, None],
            mask=dmask[:, None] & k_ok[None, :],
            other=0,
        )  # [D_PAD, TILE_N]
        v = tl.load(
            cache_ptr + plane + row[:, None] * HEAD_DIM + d[None, :],
            mask=k_ok[:, None] & dmask[None, :],
            other=0,
        )  # [TILE_N, D_PAD]
        if QUANT:
            k_scale = tl.load(scale_ptr + row, mask=k_ok, other=0.0)
            v_scale = tl.load(scale_ptr + scale_plane + row, mask=k_ok, other=0.0)
            # NOTE: inline, not a helper: the interpreter patches every nested call (ms each).
            if IS_FP8:
                k_t = k_t.to(tl.float8e4nv, bitcast=True)
                v = v.to(tl.float8e4nv, bitcast=True)
            k_t = (k_t.to(tl.float32) * k_scale[None, :]).to(q.dtype)
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
        if IEEE:
            s = tl.dot(q, k_t, input_precision="ieee")
        else:
            s = tl.dot(q, k_t)
        s = s * sm_scale
        visible = row_ok[:, None] & k_ok[None, :] & (kp[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible &= (kp[None, :] > q_pos[:, None] - window) | (kp[None, :] < sinks)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # NOTE: a row that has seen no visible key yet keeps max -inf: shift by 0 instead.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    num_heads = NUM_KV_HEADS * GROUP
    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dmask[None, :],
        )
    else:
        idx = (split * num_tokens + tok.to(tl.int64)) * num_heads + head  # [BLOCK_M]
        tl.store(
            part_out_ptr + idx[:, None] * HEAD_DIM + d[None, :],
            acc,
            mask=row_ok[:, None] & dmask[None, :],
        )
        tl.store(part_ml_ptr + idx * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + idx * 2 + 1, l_i, mask=row_ok)
