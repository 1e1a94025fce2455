"""Triton device functions that quantize KV the way ``kv_cache.py`` does.

The cache stores K/V per token per KV head as one byte per element plus a float32 scale
(``kv_cache.quantize_kv``): int8 with ``scale = amax / 127`` and round-half-to-even, or fp8
e4m3 with ``scale = amax / 448`` kept as raw uint8 bytes.

NOTE: the fp8 bytes are encoded with integer ops on the float32 bits instead of a cast to
``tl.float8e4nv``: the Triton interpreter (``TRITON_INTERPRET=1``, the CPU test path) rounds
that cast wrongly at binade edges (126.92 became 64, torch gives 128), and the integer
encoding is the same round-to-nearest-even on every device.
"""

from __future__ import annotations

import triton
import triton.language as tl

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
MIN_SCALE = 1e-12  # kv_cache._MIN_SCALE


@triton.jit
def round_half_even(y):
    """Round float32 ``y`` to the nearest integer, ties to even (torch.round)."""
    r = tl.floor(y + 0.5)
    tie = (r - y) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def fp8_e4m3_bits(y):
    """float32 ``y`` (|y| <= 448) -> its float8 e4m3fn byte (uint8), round to nearest even."""
    a = tl.abs(y)
    u = a.to(tl.uint32, bitcast=True)
    # normal range (a >= 2**-6): keep 3 mantissa bits of 23, rounding to nearest even.
    lsb = (u >> 20) & 1
    u = (u + 0x7FFFF + lsb) & 0xFFF00000
    exp = ((u >> 23) & 0xFF).to(tl.int32) - 127 + 7
    normal = (exp << 3) | ((u >> 20) & 7).to(tl.int32)
    # subnormals: multiples of 2**-9; 8 of them is the smallest normal, whose byte is 8 too.
    sub = round_half_even(a * 512.0).to(tl.int32)
    bits = tl.where(a < 0.015625, sub, normal)
    sign = ((y.to(tl.uint32, bitcast=True) >> 31) << 7).to(tl.int32)  # keeps -0.0 as torch does
    return (bits | sign).to(tl.uint8)
