"""Quantized weights kept quantized: ``QuantizedWeight`` and its constructors.

A ``QuantizedWeight`` holds one linear (or embedding) weight ``[out, in]`` in a GGML block
format, one row of blocks per output feature: ``data`` is uint8 ``[out, row_bytes]``. The
native kernels (``kvserve/runtime/native/csrc/quant/``) read six formats, each byte for byte
as GGUF stores it:

- ``q8_0``: 34 bytes / 32 values (8.5 bits a weight);
- ``q4_0``: 18 bytes / 32 values (4.5 bits);
- ``q4_1``: 20 bytes / 32 values (5.0 bits);
- ``q4_k``: 144 bytes / 256 values (4.5 bits; ``block_q4_K``: fp16 d and dmin, 6-bit scales
  and mins per 32 values);
- ``q5_k``: 176 bytes / 256 values (5.5 bits; ``block_q5_K``);
- ``q6_k``: 210 bytes / 256 values (6.5625 bits; ``block_q6_K``: int8 scales per 16 values).

The first three also have the ``x16`` layout (``quant_layout``); the K-quants are plain only.
A K-quant weight needs rows of whole super-blocks (``in`` a multiple of 256), as in the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from kvserve.config import QUANTIZATION_CHOICES as ENGINE_QUANTIZATION_CHOICES
from kvserve.models.errors import ModelLoadError
from kvserve.models.kquant_ref import quantize_kquant
from kvserve.models.quant_layout import check_layout, from_x16, to_x16

Q = GGMLQuantizationType

# Formats the kernels read, by name; and the GGUF types kept quantized (-> held format).
KERNEL_QTYPES: dict[str, GGMLQuantizationType] = {
    "q8_0": Q.Q8_0,
    "q4_0": Q.Q4_0,
    "q4_1": Q.Q4_1,
    "q4_k": Q.Q4_K,
    "q5_k": Q.Q5_K,
    "q6_k": Q.Q6_K,
}
KQUANT_QTYPES = ("q4_k", "q5_k", "q6_k")  # super-blocks of 256 values; plain layout only
X16_QTYPES = ("q8_0", "q4_0", "q4_1")  # the formats with an x16 layout
GGUF_QUANTIZED: dict[GGMLQuantizationType, str] = {v: k for k, v in KERNEL_QTYPES.items()}
DENSE_GGUF_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
QUANTIZATION_CHOICES = ENGINE_QUANTIZATION_CHOICES


def supported_gguf_qtypes() -> list[str]:
    """Names of the GGUF quantized types that can be kept quantized."""
    return [t.name for t in GGUF_QUANTIZED]


def block_values(qtype: str) -> int:
    """Values of one block of kernel format ``qtype`` (32; 256 for a K-quant)."""
    return GGML_QUANT_SIZES[KERNEL_QTYPES[qtype]][0]


def bits_per_weight(qtype: str) -> float:
    """Bits a weight held in kernel format ``qtype`` takes (the file's, scales included)."""
    block_size, type_size = GGML_QUANT_SIZES[KERNEL_QTYPES[qtype]]
    return 8.0 * type_size / block_size


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one row of ``in_features`` values in kernel format ``qtype``."""
    block_size, type_size = GGML_QUANT_SIZES[KERNEL_QTYPES[qtype]]
    return in_features // block_size * type_size


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight ``[out, in]`` held in GGML blocks (see the module docstring)."""

    qtype: str  # held (kernel) format, a KERNEL_QTYPES key
    data: torch.Tensor  # uint8 [out, row_bytes], contiguous
    shape: tuple[int, int]  # (out_features, in_features)
    layout: str = "plain"  # byte order of ``data``: "plain" or "x16" (``quant_layout``)

    def __post_init__(self) -> None:
        check_layout(self.layout)
        if self.qtype not in KERNEL_QTYPES:
            raise ValueError(f"qtype must be one of {sorted(KERNEL_QTYPES)}, got {self.qtype!r}")
        if self.layout == "x16" and self.qtype not in X16_QTYPES:
            raise ValueError(f"{self.qtype} has no x16 layout (only {', '.join(X16_QTYPES)})")
        out, inp = self.shape
        block = block_values(self.qtype)
        if inp % block:
            raise ValueError(
                f"in_features {inp} is not a multiple of the {self.qtype} block size {block}"
            )
        want = (out, row_bytes(self.qtype, inp))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(
                f"{self.qtype} data for shape {list(self.shape)} must be uint8 {list(want)}, "
                f"got {self.data.dtype} {list(self.data.shape)}"
            )

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.data.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight ``[out, in]`` (exactly the values the kernels multiply)."""
        from kvserve.models.dequant import dequantize

        raw = self.plain().data.reshape(-1).numpy()
        return dequantize(raw, KERNEL_QTYPES[self.qtype], self.shape, dtype)

    def plain(self) -> QuantizedWeight:
        """This weight in the ``plain`` (GGUF) layout (itself when it is already)."""
        if self.layout == "plain":
            return self
        data = from_x16(self.data.numpy(), self.qtype, self.in_features)
        return QuantizedWeight(self.qtype, torch.from_numpy(data), self.shape)

    def interleaved(self) -> QuantizedWeight:
        """This weight in the ``x16`` layout (the AVX-512 VNNI GEMV's; same bytes held);
        ValueError for a K-quant (``X16_QTYPES`` only)."""
        if self.layout == "x16":
            return self
        if self.qtype not in X16_QTYPES:
            raise ValueError(f"{self.qtype} has no x16 layout (only {', '.join(X16_QTYPES)})")
        data = to_x16(self.data.numpy(), self.qtype, self.in_features)
        return QuantizedWeight(self.qtype, torch.from_numpy(data), self.shape, layout="x16")

    def require_plain(self, what: str) -> None:
        """ValueError unless ``data`` is in the plain layout (``what`` names the caller)."""
        if self.layout != "plain":
            raise ValueError(f"{what} needs the plain layout, this weight is {self.layout}")

    def rows(self, start: int, end: int) -> QuantizedWeight:
        """Output rows ``[start, end)`` (a column-parallel shard), sharing no memory."""
        self.require_plain("rows()")
        return QuantizedWeight(
            self.qtype,
            self.data[start:end].clone(),
            (end - start, self.in_features),
        )

    def with_rows(self, data: torch.Tensor) -> QuantizedWeight:
        """The same format over re-ordered rows ``data`` (uint8 [out, row_bytes])."""
        self.require_plain("with_rows()")
        return QuantizedWeight(self.qtype, data.contiguous(), self.shape)

    @staticmethod
    def can_concat(parts: Sequence[QuantizedWeight]) -> bool:
        """Whether ``concat_rows`` applies: one held format and one input width."""
        return len({(p.qtype, p.in_features) for p in parts}) == 1

    @staticmethod
    def concat_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """Stack the rows of weights sharing a format and input width (fused qkv, gate_up)."""
        if not parts or not QuantizedWeight.can_concat(parts):
            kinds = [(p.qtype, p.in_features) for p in parts]
            raise ValueError(f"concat_rows needs one qtype and in_features, got {kinds}")
        for p in parts:
            p.require_plain("concat_rows()")
        return QuantizedWeight(
            parts[0].qtype,
            torch.cat([p.data for p in parts]),
            (sum(p.out_features for p in parts), parts[0].in_features),
        )

    def split_rows(self, sizes: Sequence[int]) -> list[QuantizedWeight]:
        """The weights of consecutive row ranges of ``sizes`` rows (a fused file tensor,
        Phi-3's qkv / gate_up), in the same format: whole rows of blocks move as bytes."""
        self.require_plain("split_rows()")
        if sum(sizes) != self.out_features:
            raise ValueError(f"split_rows: {list(sizes)} do not sum to {self.out_features} rows")
        parts = torch.split(self.data, list(sizes))
        return [
            QuantizedWeight(self.qtype, d, (n, self.in_features))
            for d, n in zip(parts, sizes, strict=True)
        ]


def _check_size(
    raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...], name: str, path: str
) -> None:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    numel = int(np.prod(shape, dtype=np.int64))
    if shape[-1] % block_size or raw.size != numel // block_size * type_size:
        raise ModelLoadError(
            f"{path}: tensor {name!r} of type {ggml_type.name} and shape {list(shape)} should "
            f"hold {numel // block_size * type_size} bytes in blocks of {block_size} values, "
            f"but holds {raw.size}"
        )


def from_gguf(
    raw: np.ndarray,
    ggml_type: GGMLQuantizationType,
    shape: tuple[int, int],
    *,
    name: str = "?",
    path: str = "?",
) -> QuantizedWeight:
    """Keep a quantized 2-D GGUF tensor quantized: its bytes as stored (a copy of the file's).

    Raises ``ModelLoadError`` naming the tensor for a byte size that does not match its type
    and shape, or a type the kernels do not read (suggesting ``--quantization none``).
    """
    if ggml_type not in GGUF_QUANTIZED:
        raise ModelLoadError(
            f"{path}: tensor {name!r} has type {ggml_type.name}, which cannot be kept quantized "
            f"(supported: {', '.join(supported_gguf_qtypes())}); run with --quantization none "
            "to dequantize it at load"
        )
    _check_size(raw, ggml_type, shape, name, path)
    held = GGUF_QUANTIZED[ggml_type]
    out, inp = shape
    data = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))
    return QuantizedWeight(held, data.reshape(out, row_bytes(held, inp)).contiguous(), (out, inp))


def quantize_dense(weight: torch.Tensor, qtype: str) -> QuantizedWeight:
    """Quantize a dense ``[out, in]`` weight to ``qtype`` (as llama.cpp's quantize; the
    K-quants with the simple reference quantizer of ``kquant_ref``)."""
    if qtype not in KERNEL_QTYPES:
        raise ValueError(f"qtype must be one of {sorted(KERNEL_QTYPES)}, got {qtype!r}")
    out, inp = weight.shape
    block = block_values(qtype)
    if inp % block:
        raise ValueError(
            f"cannot quantize a weight of shape {list(weight.shape)} to {qtype}: its rows are "
            f"not a multiple of {block} values"
        )
    dense = weight.detach().float().cpu().numpy()
    if qtype in KQUANT_QTYPES:
        data = quantize_kquant(dense, KERNEL_QTYPES[qtype])
    else:
        data = gguf_quants.quantize(dense, KERNEL_QTYPES[qtype])  # [out, row_bytes] uint8
    return QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(data)), (out, inp))
