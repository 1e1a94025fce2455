"""Block layouts of a quantized weight's bytes: ``plain`` (GGUF's) and ``x16`` (interleaved).

``plain``: one row of blocks per output feature, as GGUF stores it. ``x16``: the first
``out - out % 16`` rows in groups of 16 whose blocks are interleaved so that the AVX-512 VNNI
GEMV reads one 64-byte chunk of 16 rows per ``vpdpbusd`` and the scales of 16 rows in one load
(byte order in ``kvserve/runtime/native/README.md``, "Numerics"); the other rows stay plain. The
bytes held are the same (a permutation within each group): ``data`` keeps its shape
``[out, row_bytes]``, but row ``r`` of it is no longer output row ``r``.

The functions here are numpy permutations, made once at load (``to_x16``) and undone for the
dense fallback and the tests (``from_x16``).
"""

from __future__ import annotations

import numpy as np

LAYOUTS = ("plain", "x16")
GROUP = 16
# (scale fields in 2-byte units, value bytes) of one block, by held format.
_FIELDS: dict[str, tuple[int, int]] = {"q8_0": (1, 32), "q4_0": (1, 16), "q4_1": (2, 16)}


def check_layout(layout: str) -> str:
    """``layout`` if known; else ValueError naming the choices."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown quantized layout {layout!r}; choose one of {LAYOUTS}")
    return layout


def _split(qtype: str) -> tuple[int, int, int]:
    scales, values = _FIELDS[qtype]
    return scales, values, 2 * scales + values  # block bytes


def to_x16(data: np.ndarray, qtype: str, in_features: int) -> np.ndarray:
    """``plain`` bytes ``[out, row_bytes]`` -> ``x16`` bytes of the same shape (a new array)."""
    scales, values, bb = _split(qtype)
    out, rb = data.shape
    nb, groups = in_features // 32, out // GROUP
    res = data.copy()
    g = data[: groups * GROUP].reshape(groups, GROUP, nb, bb).transpose(0, 2, 1, 3)
    parts = [
        g[..., 2 * f : 2 * f + 2].reshape(groups, nb, GROUP * 2) for f in range(scales)
    ]  # the 16 d, then the 16 m: [groups, nb, 32] each
    vals = g[..., 2 * scales :].reshape(groups, nb, GROUP, values // 4, 4).transpose(0, 1, 3, 2, 4)
    parts.append(vals.reshape(groups, nb, GROUP * values))  # [chunk][row][4 bytes]
    res[: groups * GROUP] = np.concatenate(parts, axis=2).reshape(groups * GROUP, rb)
    return res


def from_x16(data: np.ndarray, qtype: str, in_features: int) -> np.ndarray:
    """``x16`` bytes -> ``plain`` bytes (the inverse of ``to_x16``; a new array)."""
    scales, values, bb = _split(qtype)
    out, rb = data.shape
    nb, groups = in_features // 32, out // GROUP
    res = data.copy()
    g = data[: groups * GROUP].reshape(groups, nb, GROUP * bb)
    blocks = np.empty((groups, nb, GROUP, bb), dtype=np.uint8)
    for f in range(scales):
        blocks[..., 2 * f : 2 * f + 2] = g[..., 32 * f : 32 * f + 32].reshape(groups, nb, GROUP, 2)
    vals = g[..., 32 * scales :].reshape(groups, nb, values // 4, GROUP, 4).transpose(0, 1, 3, 2, 4)
    blocks[..., 2 * scales :] = vals.reshape(groups, nb, GROUP, values)
    res[: groups * GROUP] = blocks.transpose(0, 2, 1, 3).reshape(groups * GROUP, rb)
    return res
