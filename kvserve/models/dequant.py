"""GGML tensor types -> dense torch tensors.

F32 / F16 / BF16 / Q8_0 / Q4_0 / Q4_1 are decoded with torch (multi-threaded, chunked so the
temporaries stay small); the arithmetic is the same as ``gguf.quants`` (and so as llama.cpp
and transformers), giving bit-identical fp32 values. The K-quants and Q5_0 / Q5_1 fall back
to ``gguf.quants.dequantize`` (numpy, slower). Other types raise ``ModelLoadError``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from kvserve.models.errors import ModelLoadError

Q = GGMLQuantizationType

FAST_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1})
NUMPY_TYPES = frozenset({Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})
SUPPORTED_TYPES = FAST_TYPES | NUMPY_TYPES

# Blocks decoded per chunk: 2048 blocks of 32 values = 256 KiB of fp32 temporaries.
# NOTE: small chunks keep the temporaries in cache; this was 2-3x faster than 64k blocks.
_CHUNK_BLOCKS = 2048


@contextmanager
def single_threaded() -> Iterator[None]:
    """Run torch ops on one intra-op thread inside the block, restoring the count after.

    NOTE: dequantisation is thousands of small, memory-bound ops. With 2 threads each op
    is an OpenMP fork/join; when another process holds the second core every join waits for
    a scheduler time slice, and loading the embedded model took 40-60 s instead of ~1 s.
    One thread is as fast on an idle machine and immune to that.
    """
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


def supported_type_names() -> list[str]:
    """Names of the GGML tensor types this module can decode."""
    return sorted(t.name for t in SUPPORTED_TYPES)


def dequantize(
    raw: np.ndarray,
    ggml_type: GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    name: str = "?",
    path: str = "?",
) -> torch.Tensor:
    """Decode the raw bytes ``raw`` (uint8) of one GGML tensor into a dense tensor.

    Returns a new tensor of ``shape`` and ``dtype`` that owns its memory. Raises
    ``ModelLoadError`` naming ``path`` and ``name`` for an unsupported type.
    """
    if ggml_type not in SUPPORTED_TYPES:
        raise ModelLoadError(
            f"{path}: tensor {name!r} has unsupported quantization type {ggml_type.name} "
            f"(supported: {', '.join(supported_type_names())})"
        )
    num_elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if ggml_type in NUMPY_TYPES:
        dense = gguf_quants.dequantize(np.asarray(raw), ggml_type)  # float32
        return torch.from_numpy(np.ascontiguousarray(dense)).reshape(shape).to(dtype).clone()
    data = torch.from_numpy(np.asarray(raw))  # [num_bytes] uint8, backed by the memory map
    if ggml_type == Q.F32:
        return data.view(torch.float32).reshape(shape).to(dtype, copy=True)
    if ggml_type == Q.F16:
        return data.view(torch.float16).reshape(shape).to(dtype, copy=True)
    if ggml_type == Q.BF16:
        return data.view(torch.bfloat16).reshape(shape).to(dtype, copy=True)

    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = data.view(-1, type_size)  # [num_blocks, bytes_per_block]
    out = torch.empty(blocks.shape[0], block_size, dtype=dtype)  # [num_blocks, block_size]
    decode = _DECODERS[ggml_type]
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        end = min(start + _CHUNK_BLOCKS, blocks.shape[0])
        out[start:end] = decode(blocks[start:end])
    assert out.numel() == num_elements
    return out.reshape(shape)


def _f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte ``start`` of every block, as fp32. [num_blocks, 1]"""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Unpack 16 bytes of 4-bit values: low nibbles are elements 0..15, high ones 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)  # [num_blocks, 32] uint8


def _decode_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # block: fp16 d, 32 x int8 q; x = q * d
    d = _f16_field(blocks, 0)  # [num_blocks, 1]
    q = blocks[:, 2:].view(torch.int8).float()  # [num_blocks, 32]
    return q * d


def _decode_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # block: fp16 d, 16 bytes of nibbles; x = d * (q - 8)
    d = _f16_field(blocks, 0)  # [num_blocks, 1]
    q = _nibbles(blocks[:, 2:]).float() - 8.0  # [num_blocks, 32]
    return d * q


def _decode_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # block: fp16 d, fp16 m, 16 bytes of nibbles; x = d * q + m
    d = _f16_field(blocks, 0)  # [num_blocks, 1]
    m = _f16_field(blocks, 2)  # [num_blocks, 1]
    q = _nibbles(blocks[:, 4:]).float()  # [num_blocks, 32]
    return d * q + m


_DECODERS = {Q.Q8_0: _decode_q8_0, Q.Q4_0: _decode_q4_0, Q.Q4_1: _decode_q4_1}
