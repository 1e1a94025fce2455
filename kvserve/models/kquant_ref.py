"""K-quant blocks (Q4_K, Q5_K, Q6_K) from dense weights: a simple reference quantizer.

The ``gguf`` package decodes the K-quants but cannot encode them (``gguf.quants.quantize``
raises ``NotImplementedError``). Kernel selection needs weights of a K-quant format to time
its kernels (``quant_select.kernel_source``), and the tests need files of these types; this
writes the GGML block layouts (``block_q4_K``, ``block_q5_K``, ``block_q6_K``, as
``gguf.quants`` reads them) with plain min / max scales. NOTE: not llama.cpp's quantizer
(``make_qkx2_quants`` searches the scales that minimise the error): the bytes are valid blocks
of the format, the rounding error is larger than llama.cpp's. GGUF files quantized by
llama.cpp are loaded as stored and never pass through here.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
SUPER = 256


def quantize_kquant(dense: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``dense`` [rows, k] (k a multiple of 256) -> uint8 [rows, row_bytes] blocks of ``qtype``."""
    rows, k = dense.shape
    if k % SUPER:
        raise ValueError(f"{qtype.name} rows hold super-blocks of {SUPER} values; got {k}")
    x = np.ascontiguousarray(dense, dtype=np.float32).reshape(-1, SUPER)
    if qtype in (Q.Q4_K, Q.Q5_K):
        blocks = _q45_k(x, 15 if qtype == Q.Q4_K else 31)
    elif qtype == Q.Q6_K:
        blocks = _q6_k(x)
    else:
        raise ValueError(f"not a K-quant this quantizer writes: {qtype.name}")
    assert blocks.shape[1] == GGML_QUANT_SIZES[qtype][1]
    return blocks.reshape(rows, -1)


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b > 0)


def _q45_k(x: np.ndarray, levels: int) -> np.ndarray:
    nb = x.shape[0]
    sub = x.reshape(nb, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)  # value = d sc q - dmin m: the offset is <= 0
    scale = (sub.max(axis=2) - lo) / levels  # [nb, 8]
    d = _f16(scale.max(axis=1) / 63)
    dmin = _f16((-lo).max(axis=1) / 63)
    sc = np.clip(np.rint(_div(scale, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_div(-lo, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    eff_d = d.astype(np.float32)[:, None] * sc
    eff_m = dmin.astype(np.float32)[:, None] * mn
    q = _div(sub + eff_m[..., None], np.broadcast_to(eff_d[..., None], sub.shape))
    q = np.clip(np.rint(q), 0, levels).astype(np.uint8)  # [nb, 8, 32]
    scales = np.empty((nb, 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    pairs = q.reshape(nb, 4, 2, 32)  # sub-blocks 2 j and 2 j + 1 share bytes 32 j..
    qs = ((pairs[:, :, 0] & 0x0F) | ((pairs[:, :, 1] & 0x0F) << 4)).reshape(nb, 128)
    parts = [d.reshape(nb, 1).view(np.uint8), dmin.reshape(nb, 1).view(np.uint8), scales]
    if levels == 31:  # Q5_K: bit 4 of value l of sub-block i is bit i of qh[l]
        bits = (q >> 4) & 1  # [nb, 8, 32]
        qh = (bits << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    sub = x.reshape(nb, 16, 16)
    scale = np.abs(sub).max(axis=2) / 31  # [nb, 16]
    d = _f16(scale.max(axis=1) / 127)
    sc = np.clip(np.rint(_div(scale, d.astype(np.float32)[:, None])), -128, 127).astype(np.int8)
    eff = d.astype(np.float32)[:, None] * sc
    q = _div(sub, np.broadcast_to(eff[..., None], sub.shape))
    q = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)  # h, c, l
    ql = (q[:, :, 0:2] & 0x0F) | ((q[:, :, 2:4] & 0x0F) << 4)  # [nb, 2, 2, 32]
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    qh = (((q >> 4) & 3) << shifts).sum(axis=2, dtype=np.uint8)  # [nb, 2, 32]
    return np.concatenate(
        [
            ql.reshape(nb, 128),
            qh.reshape(nb, 64),
            sc.view(np.uint8),
            d.reshape(nb, 1).view(np.uint8),
        ],
        axis=1,
    )
