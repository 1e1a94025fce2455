"""Quantized weights kept quantized: ``QuantizedWeight`` and its constructors.

A ``QuantizedWeight`` holds one linear (or embedding) weight ``[out, in]`` in a GGML block
format, one row of blocks per output feature: ``data`` is uint8 ``[out, row_bytes]``. The
native kernels (``kvserve/runtime/native/csrc/quant/``) read three formats:

- ``q8_0``: 34 bytes / 32 values (8.5 bits a weight), as stored by GGUF;
- ``q4_0``: 18 bytes / 32 values (4.5 bits), as stored;
- ``q4_1``: 20 bytes / 32 values (5.0 bits), as stored.

The K-quants are repacked once at load (``source_qtype`` keeps the file's type):

- ``q4_k`` -> ``q4_1``: every 32-value sub-block of a Q4_K super-block is a Q4_1 block with
  ``d = fp16(d * sc)`` and ``m = fp16(-dmin * m)``; the 4-bit values are unchanged. 5.0 bits a
  weight instead of 4.5; the fp16 rounding of the two products is at most 2^-11 relative.
- ``q6_k`` -> ``q8_0``: Q6_K scales every 16 values, which no 32-value format holds, so the
  dequantized values are re-quantized to Q8_0 (8.5 bits instead of 6.56; the added error is
  at most half a Q8_0 step, max|block| / 254, plus the fp16 rounding of its scale).

NOTE: a repack to the native K-quant kernels (llama.cpp's ``vec_dot_q4_K_q8_K``) would keep
the 4.5 / 6.56 bits; it is not written yet.
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
from kvserve.models.quant_layout import check_layout, from_x16, to_x16

Q = GGMLQuantizationType

# Formats the kernels read, by name; and the GGUF types kept quantized (-> held format).
KERNEL_QTYPES: dict[str, GGMLQuantizationType] = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1}
GGUF_QUANTIZED: dict[GGMLQuantizationType, str] = {
    Q.Q8_0: "q8_0",
    Q.Q4_0: "q4_0",
    Q.Q4_1: "q4_1",
    Q.Q4_K: "q4_1",
    Q.Q6_K: "q8_0",
}
DENSE_GGUF_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
QUANTIZATION_CHOICES = ENGINE_QUANTIZATION_CHOICES
BLOCK = 32


def supported_gguf_qtypes() -> list[str]:
    """Names of the GGUF quantized types that can be kept quantized."""
    return [t.name for t in GGUF_QUANTIZED]


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one row of ``in_features`` values in kernel format ``qtype``."""
    block_size, type_size = GGML_QUANT_SIZES[KERNEL_QTYPES[qtype]]
    return in_features // block_size * type_size


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight ``[out, in]`` held in GGML blocks (see the module docstring)."""

    qtype: str  # held (kernel) format: "q8_0", "q4_0" or "q4_1"
    data: torch.Tensor  # uint8 [out, row_bytes], contiguous
    shape: tuple[int, int]  # (out_features, in_features)
    source_qtype: str = ""  # the file's type ("q4_k", ...); "" = same as qtype
    layout: str = "plain"  # byte order of ``data``: "plain" or "x16" (``quant_layout``)

    def __post_init__(self) -> None:
        check_layout(self.layout)
        if self.qtype not in KERNEL_QTYPES:
            raise ValueError(f"qtype must be one of {sorted(KERNEL_QTYPES)}, got {self.qtype!r}")
        out, inp = self.shape
        if inp % BLOCK:
            raise ValueError(f"in_features {inp} is not a multiple of the block size {BLOCK}")
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
        return QuantizedWeight(self.qtype, torch.from_numpy(data), self.shape, self.source_qtype)

    def interleaved(self) -> QuantizedWeight:
        """This weight in the ``x16`` layout (the AVX-512 VNNI GEMV's; same bytes held)."""
        if self.layout == "x16":
            return self
        data = to_x16(self.data.numpy(), self.qtype, self.in_features)
        return QuantizedWeight(
            self.qtype, torch.from_numpy(data), self.shape, self.source_qtype, "x16"
        )

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
            self.source_qtype,
        )

    def with_rows(self, data: torch.Tensor) -> QuantizedWeight:
        """The same format over re-ordered rows ``data`` (uint8 [out, row_bytes])."""
        self.require_plain("with_rows()")
        return QuantizedWeight(self.qtype, data.contiguous(), self.shape, self.source_qtype)

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
        sources = {p.source_qtype for p in parts}
        return QuantizedWeight(
            parts[0].qtype,
            torch.cat([p.data for p in parts]),
            (sum(p.out_features for p in parts), parts[0].in_features),
            sources.pop() if len(sources) == 1 else "mixed",
        )

    def split_rows(self, sizes: Sequence[int]) -> list[QuantizedWeight]:
        """The weights of consecutive row ranges of ``sizes`` rows (a fused file tensor,
        Phi-3's qkv / gate_up), in the same format: whole rows of blocks move as bytes."""
        self.require_plain("split_rows()")
        if sum(sizes) != self.out_features:
            raise ValueError(f"split_rows: {list(sizes)} do not sum to {self.out_features} rows")
        parts = torch.split(self.data, list(sizes))
        return [
            QuantizedWeight(self.qtype, d, (n, self.in_features), self.source_qtype)
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
    """Keep a quantized 2-D GGUF tensor quantized (K-quants repacked, see module docstring).

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
    if ggml_type == Q.Q4_K:
        data = torch.from_numpy(_repack_q4_k(np.asarray(raw)))
    elif ggml_type == Q.Q6_K:
        dense = gguf_quants.dequantize(np.asarray(raw), Q.Q6_K).reshape(shape)
        data = torch.from_numpy(np.ascontiguousarray(gguf_quants.quantize(dense, Q.Q8_0)))
    else:
        data = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))
    return QuantizedWeight(
        held,
        data.reshape(out, row_bytes(held, inp)).contiguous(),
        (out, inp),
        ggml_type.name.lower(),
    )


def _repack_q4_k(raw: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks (144 bytes / 256 values) -> Q4_1 blocks (8 x 20 bytes)."""
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[Q.Q4_K][1])  # [nb, 144]
    nb = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [nb, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)  # [nb, 1]
    sc, mn = gguf_quants.Q4_K.get_scale_min(blocks[:, 4:16])  # [nb, 8] each
    qs = blocks[:, 16:].reshape(nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(
        1, 1, 2, 1
    )
    q = (qs & 0x0F).reshape(nb, 8, 32)  # [nb, 8 sub-blocks, 32 values]
    out = np.empty((nb, 8, 20), dtype=np.uint8)
    out[:, :, 0:2] = (d * sc.astype(np.float32)).astype(np.float16)[..., None].view(np.uint8)
    out[:, :, 2:4] = (-dmin * mn.astype(np.float32)).astype(np.float16)[..., None].view(np.uint8)
    out[:, :, 4:] = q[:, :, :16] | (q[:, :, 16:] << 4)
    return out.reshape(-1)


def quantize_dense(weight: torch.Tensor, qtype: str) -> QuantizedWeight:
    """Quantize a dense ``[out, in]`` weight to ``qtype`` at load (as llama.cpp's quantize)."""
    if qtype not in KERNEL_QTYPES:
        raise ValueError(f"qtype must be one of {sorted(KERNEL_QTYPES)}, got {qtype!r}")
    out, inp = weight.shape
    if inp % BLOCK:
        raise ValueError(
            f"cannot quantize a weight of shape {list(weight.shape)} to {qtype}: its rows are "
            f"not a multiple of {BLOCK} values"
        )
    dense = weight.detach().float().cpu().numpy()
    data = gguf_quants.quantize(dense, KERNEL_QTYPES[qtype])  # [out, row_bytes] uint8
    return QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(data)), (out, inp))
