"""int8 weights on AMX int8 tiles (``kvserve::amx_int8_linear``): the packing and its inverse.

The kernel (``kvserve/runtime/native/csrc/amx_int8.cpp``) multiplies bf16 activations,
quantized per row and block of 64 inputs on the fly, by a weight held as int8 per output
column and block of 64 inputs, both with an fp32 scale. ``pack_int8_weight`` makes that copy
once at load from a float weight; the quantized-weight candidate that holds it is
``QuantAmxInt8Method`` (``kvserve/models/quant_linear.py``). The rounding changes results
(bench/ACCURACY.md), so only weights that are quantized already get it.
"""

from __future__ import annotations

import torch

from kvserve.runtime import native

GROUP = 32  # output columns per packed group (two 16-column B tiles)
KBLOCK = 64  # inputs per block: one tile row of int8, one scale
BLOCK_BYTES = 2 * 16 * 64 + GROUP * 4  # a group's two B tiles and 32 fp32 scales per block


def amx_int8_available() -> bool:
    """Whether ``kvserve::amx_int8_linear`` can run here (native kernels built with AMX-INT8
    and the tile state granted by the kernel)."""
    return native.available() and bool(native.ops().amx_int8_supported())


def packed_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """The packed tensor's shape for a weight ``[out_features, in_features]``."""
    return -(-out_features // GROUP), -(-in_features // KBLOCK) * BLOCK_BYTES


def _inverse_scale(amax: torch.Tensor) -> torch.Tensor:
    """``127 / amax`` (0 where ``amax`` is 0), one IEEE division as the kernel's.

    NOTE: not ``127.0 / amax``: torch computes a scalar over a tensor as the tensor's
    reciprocal times the scalar, two roundings, which moved x * inv across a .5 tie (x =
    -3.265625 in a block of max 6.53125 rounded to -63, the kernel's -64).
    """
    return torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))


def _round_blocks(t: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` [R, K] -> ``q`` [rows, Kp] int8 and ``scale`` [rows, Kp / 64] fp32 with
    ``t ~ scale * q`` per block of 64 inputs, ``t`` zero-padded to ``rows`` rows and whole
    blocks (``q = round(t * (127 / max|t|))`` to nearest even, as the kernel rounds x)."""
    kblocks = -(-t.shape[1] // KBLOCK)
    padded = torch.zeros(rows, kblocks * KBLOCK, dtype=torch.float32)
    padded[: t.shape[0], : t.shape[1]] = t
    blocks = padded.view(rows, kblocks, KBLOCK)
    amax = blocks.abs().amax(2)  # [rows, KB]
    q = torch.round(blocks * _inverse_scale(amax)[..., None]).clamp_(-127, 127)
    return q.to(torch.int8).view(rows, kblocks * KBLOCK), amax / 127.0


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] -> ``q`` [Np, Kp] int8 and ``scale`` [Np, Kp / 64] fp32 with
    ``weight ~ scale * q`` per block of 64 inputs, zero-padded to whole groups of 32 rows and
    blocks (rounded as ``_round_blocks``)."""
    n, k = weight.shape
    if n == 0 or k == 0:
        raise ValueError(f"an int8-packed weight needs both dims non-zero, got {n}x{k}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("an int8-packed weight must be finite")
    return _round_blocks(weight, -(-n // GROUP) * GROUP)


def pack_int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] (float) -> int8 [ceil(N/32), ceil(K/64) * 2176]: per group of 32
    columns and block of 64 inputs, two B tiles, byte ``[nb][kq][4c + j]`` = ``q[32g + 16nb + c,
    64kb + 4kq + j]``, then the block's 32 column scales (fp32 bytes)."""
    q, scale = quantize_blocks(weight)
    groups, kblocks = q.shape[0] // GROUP, scale.shape[1]
    # [G, nb, c, KB, kq, j] -> [G, KB, nb, kq, c, j]
    tiles = q.view(groups, 2, 16, kblocks, 16, 4).permute(0, 3, 1, 4, 2, 5)
    tiles = tiles.reshape(groups, kblocks, 2 * 16 * 64)
    scales = scale.view(groups, GROUP, kblocks).permute(0, 2, 1).contiguous()  # [G, KB, 32]
    packed = torch.cat([tiles, scales.view(torch.int8)], dim=2)  # [G, KB, 2176]
    return packed.reshape(groups, kblocks * BLOCK_BYTES).contiguous()


def unpack_int8_weight(
    packed: torch.Tensor, out_features: int, in_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``pack_int8_weight``: ``q`` [N, K] int8 and ``scale`` [N, ceil(K/64)]
    fp32 (``scale[:, kb]`` is the scale of inputs ``64kb .. 64kb + 63``)."""
    groups = packed.shape[0]
    kblocks = packed.shape[1] // BLOCK_BYTES
    blocks = packed.view(groups, kblocks, BLOCK_BYTES)
    tiles = blocks[:, :, : 2 * 16 * 64].reshape(groups, kblocks, 2, 16, 16, 4)
    q = tiles.permute(0, 2, 4, 1, 3, 5).reshape(groups * GROUP, kblocks * KBLOCK)
    scales = blocks[:, :, 2 * 16 * 64 :].contiguous().view(torch.float32)  # [G, KB, 32]
    scale = scales.permute(0, 2, 1).reshape(groups * GROUP, kblocks)
    return q[:out_features, :in_features].contiguous(), scale[:out_features].contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel makes of ``x`` [M, K] (bf16): ``q`` [M, K] int8 and ``scale``
    [M, ceil(K/64)] fp32, rounded as the kernel rounds (a reference for tests and probes)."""
    q, scale = _round_blocks(x.float(), x.shape[0])
    return q[:, : x.shape[1]].contiguous(), scale
