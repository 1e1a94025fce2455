"""A small, fast GGUF parser: metadata and tensor descriptors over a memory map.

NOTE: ``gguf.GGUFReader`` builds a numpy view for every element of every metadata array (the
49k-entry vocabulary and merges), which costs ~2 s on the embedded model. We only need scalar
metadata and array lengths (the tokenizer is read by transformers), so this parser skips array
payloads and takes ~10 ms. Tensor data stays in the memory map until it is dequantised.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvserve.models.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> (struct format, size in bytes); 8 = string, 9 = array.
_SCALAR_FORMATS: dict[int, tuple[str, int]] = {
    0: ("<B", 1),  # UINT8
    1: ("<b", 1),  # INT8
    2: ("<H", 2),  # UINT16
    3: ("<h", 2),  # INT16
    4: ("<I", 4),  # UINT32
    5: ("<i", 4),  # INT32
    6: ("<f", 4),  # FLOAT32
    7: ("<?", 1),  # BOOL
    10: ("<Q", 8),  # UINT64
    11: ("<q", 8),  # INT64
    12: ("<d", 8),  # FLOAT64
}
_FLOAT32 = 6
_STRING = 8
_ARRAY = 9


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array whose payload was skipped: its element type and length only."""

    element_type: int
    length: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's descriptor. ``shape`` is in numpy (row-major) order, outermost first."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    data: np.ndarray  # raw bytes, uint8 view of the memory map

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


@dataclass(frozen=True)
class GGUFFile:
    """Parsed GGUF file: scalar metadata (arrays as ``GGUFArray``) and tensors by name."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]


class _Cursor:
    """Bounds-checked little-endian reads over a byte buffer."""

    def __init__(self, buf: np.ndarray, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path
        self.size = int(buf.shape[0])

    def need(self, num_bytes: int, what: str) -> None:
        if num_bytes < 0 or self.pos + num_bytes > self.size:
            raise ModelLoadError(
                f"{self.path}: corrupt or truncated GGUF header: reading {what} needs "
                f"{num_bytes} bytes at offset {self.pos}, but the file has {self.size} bytes"
            )

    def scalar(self, fmt: str, size: int, what: str) -> Any:
        self.need(size, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def string(self, what: str) -> str:
        length = self.u64(f"length of {what}")
        self.need(length, what)
        raw = bytes(self.buf[self.pos : self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{self.path}: corrupt GGUF header: {what} is not UTF-8") from e

    def skip_string(self, what: str) -> None:
        length = self.u64(f"length of {what}")
        self.need(length, what)
        self.pos += length


def _read_value(cur: _Cursor, value_type: int, key: str) -> Any:
    if value_type in _SCALAR_FORMATS:
        fmt, size = _SCALAR_FORMATS[value_type]
        value = cur.scalar(fmt, size, f"value of {key!r}")
        if value_type == _FLOAT32:
            # NOTE: the shortest decimal that round-trips in float32 is the value the writer
            # meant (1e-05, not 9.999999747378752e-06).
            value = float(str(np.float32(value)))
        return value
    if value_type == _STRING:
        return cur.string(f"value of {key!r}")
    if value_type == _ARRAY:
        element_type = cur.u32(f"array type of {key!r}")
        length = cur.u64(f"array length of {key!r}")
        if element_type in _SCALAR_FORMATS:
            size = _SCALAR_FORMATS[element_type][1]
            cur.need(length * size, f"array {key!r}")
            cur.pos += length * size
        elif element_type == _STRING:
            for _ in range(length):
                cur.skip_string(f"element of array {key!r}")
        else:
            # NOTE: nested arrays do not occur in llama-family files; refuse rather than guess.
            raise ModelLoadError(
                f"{cur.path}: unsupported GGUF array element type {element_type} in {key!r}"
            )
        return GGUFArray(element_type, length)
    raise ModelLoadError(
        f"{cur.path}: corrupt GGUF header: unknown value type {value_type} for key {key!r}"
    )


def read_gguf(path: str) -> GGUFFile:
    """Parse the header of the GGUF file at ``path`` and map its tensors (no data is read).

    Raises ``ModelLoadError`` naming the file for a bad magic, an unsupported version, a
    truncated or corrupt header, an unknown tensor type or tensor data beyond the file's end.
    """
    try:
        # NOTE: mode "c" (copy-on-write) gives writable arrays, so torch.from_numpy does not
        # warn; nothing is ever written back to the file.
        buf = np.memmap(path, dtype=np.uint8, mode="c")
    except ValueError as e:  # an empty file cannot be mapped
        raise ModelLoadError(f"{path}: not a GGUF file (empty)") from e
    cur = _Cursor(buf, path)
    cur.need(4, "magic")
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ModelLoadError(
            f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r})"
        )
    cur.pos = 4
    version = cur.u32("version")
    if version not in (2, 3):
        raise ModelLoadError(
            f"{path}: unsupported GGUF version {version} (supported: 2, 3; a huge number means "
            "a big-endian file, which is not supported)"
        )
    num_tensors = cur.u64("tensor count")
    num_kv = cur.u64("metadata count")
    if num_tensors > cur.size or num_kv > cur.size:
        raise ModelLoadError(f"{path}: corrupt GGUF header: {num_tensors} tensors, {num_kv} keys")

    metadata: dict[str, Any] = {}
    for i in range(num_kv):
        key = cur.string(f"metadata key #{i}")
        value_type = cur.u32(f"type of {key!r}")
        metadata[key] = _read_value(cur, value_type, key)

    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for i in range(num_tensors):
        name = cur.string(f"name of tensor #{i}")
        num_dims = cur.u32(f"dimension count of {name!r}")
        if num_dims > 8:
            raise ModelLoadError(
                f"{path}: corrupt GGUF header: tensor {name!r} has {num_dims} dimensions"
            )
        dims = [cur.u64(f"shape of {name!r}") for _ in range(num_dims)]
        type_id = cur.u32(f"type of {name!r}")
        offset = cur.u64(f"data offset of {name!r}")
        # GGUF lists the innermost (contiguous) dimension first; numpy wants it last.
        infos.append((name, tuple(reversed(dims)), type_id, offset))

    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"{path}: corrupt GGUF header: alignment {alignment}")
    data_start = (cur.pos + alignment - 1) // alignment * alignment

    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, type_id, offset in infos:
        tensors[name] = _tensor_info(path, buf, data_start, name, shape, type_id, offset)
    _check_no_overlap(path, infos, tensors)
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors)


def _tensor_info(
    path: str,
    buf: np.ndarray,
    data_start: int,
    name: str,
    shape: tuple[int, ...],
    type_id: int,
    offset: int,
) -> GGUFTensorInfo:
    try:
        ggml_type = GGMLQuantizationType(type_id)
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensor {name!r} has unknown GGML type id {type_id}") from e
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    inner = shape[-1] if shape else 1
    if inner % block_size:
        raise ModelLoadError(
            f"{path}: tensor {name!r} of type {ggml_type.name} has row length {inner}, not a "
            f"multiple of its block size {block_size}"
        )
    num_elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
    num_bytes = num_elements // block_size * type_size
    start = data_start + offset
    if start + num_bytes > buf.shape[0]:
        raise ModelLoadError(
            f"{path}: truncated GGUF file: tensor {name!r} needs bytes [{start}, "
            f"{start + num_bytes}) but the file has {buf.shape[0]} bytes"
        )
    return GGUFTensorInfo(name, shape, ggml_type, buf[start : start + num_bytes])


def _check_no_overlap(
    path: str,
    infos: list[tuple[str, tuple[int, ...], int, int]],
    tensors: dict[str, GGUFTensorInfo],
) -> None:
    """Each tensor's bytes (from its type and shape) must end before the next one starts.

    NOTE: a tensor whose declared type or shape does not match the bytes written for it
    shows up here: its size, computed from type and shape, runs into the next tensor.
    """
    by_offset = sorted(infos, key=lambda item: item[3])
    for (name, shape, _, offset), (next_name, _, _, next_offset) in zip(
        by_offset, by_offset[1:], strict=False
    ):
        info = tensors[name]
        if offset + info.data.size > next_offset:
            raise ModelLoadError(
                f"{path}: tensor {name!r} of type {info.type_name} and shape {list(shape)} "
                f"needs {info.data.size} bytes, but only {next_offset - offset} lie before "
                f"the next tensor {next_name!r}: its type or shape does not match its data"
            )
