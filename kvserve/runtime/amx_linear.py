"""The AMX linear method: bf16 projections on Intel AMX tiles (``kvserve::amx_linear``).

A candidate of the kernel selection like oneDNN prepacked: offered on CPU for bf16
activations when the native kernels were built with AMX-BF16 and the kernel granted this
process the tile state; the selection times it per M bucket and keeps it where it wins
(README, "Kernels and dtype"). The weight is repacked once at load into the tile layout
that ``native/csrc/amx_linear.cpp`` describes, zero-padded to whole tiles; the packing is a
padded permutation, so the packed copy rebuilds the weight exactly and the dense source can
be freed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from kvserve.runtime import native
from kvserve.runtime.autotune.candidates import register_candidates
from kvserve.runtime.linear import LinearMethod

log = logging.getLogger(__name__)

GROUP = 32  # output columns per packed group (two 16-column B tiles)
KBLOCK = 32  # inputs per tile row of pairs (16 pairs of bf16)


def amx_available() -> bool:
    """Whether ``kvserve::amx_linear`` can run here (native kernels built with AMX-BF16 and
    the tile state granted by the kernel)."""
    return native.available() and bool(native.ops().amx_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] -> the tile layout [ceil(N/32), ceil(K/32), 2, 16, 32] (bf16), the
    weight zero-padded to whole groups of 32 columns and blocks of 32 inputs.

    Element ``[g, kb, nb, kp, 2c + j]`` is ``weight[32g + 16nb + c, 32kb + 2kp + j]``.
    """
    n, k = weight.shape
    if n == 0 or k == 0:
        raise ValueError(f"an AMX-packed weight needs both dims non-zero, got {n}x{k}")
    groups, kblocks = -(-n // GROUP), -(-k // KBLOCK)
    w = torch.zeros(groups * GROUP, kblocks * KBLOCK, dtype=torch.bfloat16)
    w[:n, :k] = weight
    # [G, nb, c, KB, kp, j] -> [G, KB, nb, kp, c, j]
    tiles = w.view(groups, 2, 16, kblocks, 16, 2).permute(0, 3, 1, 4, 2, 5)
    return tiles.reshape(groups, kblocks, 2, 16, 32).contiguous()


def unpack_weight(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The inverse of ``pack_weight``: the tile layout -> ``[out_features, in_features]``."""
    groups, kblocks = packed.shape[:2]
    tiles = packed.view(groups, kblocks, 2, 16, 16, 2).permute(0, 2, 4, 1, 3, 5)
    dense = tiles.reshape(groups * GROUP, kblocks * KBLOCK)
    return dense[:out_features, :in_features].contiguous()


def run_packed(
    op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
    packed: torch.Tensor,
    x: torch.Tensor,  # [M, in]
    out: torch.Tensor | None,  # [M, out_features] or None
    out_features: int,
) -> torch.Tensor:
    """``op(out, x, packed)`` (an AMX kernel writing ``out``) on ``x`` with contiguous rows,
    into a new ``out`` when none is given; returns ``out``."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(x.shape[0], out_features, dtype=x.dtype)  # [M, out]
    op(out, x, packed)
    return out


class AmxBf16Method(LinearMethod):
    """``kvserve::amx_linear`` on the weight repacked into AMX tiles (bf16 in, bf16 out).

    Not shape-cached (no per-M state): ``Linear`` calls it with the exact row count.
    """

    name = "amx_bf16"
    rebuilds_dtype = torch.bfloat16

    def __init__(self, weight: torch.Tensor) -> None:
        if not amx_available():
            raise RuntimeError(f"amx_bf16 needs AMX-BF16 native kernels: {native.reason()}")
        self.out_features, self.in_features = weight.shape
        self._source: torch.Tensor | None = weight  # [out, in], until prepare
        self.packed: torch.Tensor | None = None  # [ceil(out/32), ceil(in/32), 2, 16, 32]

    def prepare(self) -> None:
        if self.packed is None:
            assert self._source is not None
            self.packed = pack_weight(self._source)
            self._source = None

    @property
    def nbytes(self) -> int:
        rows = -(-self.out_features // GROUP) * GROUP
        return rows * -(-self.in_features // KBLOCK) * KBLOCK * 2  # bf16, padded

    def streamed_tensors(self) -> list[torch.Tensor]:
        return [] if self.packed is None else [self.packed]

    def dense_weight(self) -> torch.Tensor:
        self.prepare()
        assert self.packed is not None
        return unpack_weight(self.packed, self.out_features, self.in_features)

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self.prepare()
        assert self.packed is not None
        return run_packed(torch.ops.kvserve.amx_linear, self.packed, x, out, self.out_features)


@register_candidates
def amx_candidates(
    source: Any, *, act_dtype: torch.dtype, device: torch.device
) -> list[LinearMethod]:
    """``AmxBf16Method`` for a dense 2-D weight with bf16 activations on an AMX CPU."""
    if (
        device.type != "cpu"
        or act_dtype != torch.bfloat16
        or not isinstance(source, torch.Tensor)
        or source.dim() != 2
        or 0 in source.shape
    ):
        return []
    if not amx_available():
        log.debug("linear candidate amx_bf16 skipped: %s", native.reason() or "no AMX-BF16")
        return []
    return [AmxBf16Method(source)]
