"""Native quantized-weight kernels (``csrc/quant/``, ``torch.ops.kvserve_quant``).

Built on first use like the other native kernels (same compiler flags and cache directory,
``kvserve/runtime/native/__init__.py``), as a second extension of its own, so the two libraries
build and change independently; README.md beside this file has the files, the formats and the
numerics. ``load()`` never raises: it returns False and ``reason()`` says why (no compiler,
``KVSERVE_NATIVE=0``); quantized weights then run dequantized.

Ops: ``linear(out, x, weight, qtype, bias, isa, layout)`` (y = x @ W^T + b over GGML blocks, int8
activations, see README.md), ``embedding(out, ids, weight, qtype, layout)`` (gather and
dequantize rows), ``amx_bf16_linear(out, x, weight, qtype)`` (bf16 x times an x16 weight
dequantized inside an AMX bf16 GEMM), ``isa_supported(isa)`` and ``best_isa()``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import torch

from kvserve.runtime import native

# NOTE: one op library from these files; quant_bindings.cpp registers every op of them.
SOURCES = tuple(
    native.CSRC / "quant" / name
    for name in (
        "quant_bindings.cpp",
        "quant_linear.cpp",
        "quant_linear_x16.cpp",
        "quant_amx_bf16.cpp",
        "quant_embedding.cpp",
        "quant_q4_k.cpp",
        "quant_q5_k.cpp",
        "quant_q6_k.cpp",
    )
)
# Headers the sources include (the AMX kernel: the tile helpers it shares with the other library).
HEADERS = (
    native.CSRC / "quant" / "quant_common.h",
    native.CSRC / "quant" / "quant_kquant.h",
    native.CSRC / "arch" / "amx_tiles.h",
)

# Kernel qtype codes (the formats the kernels read, every one as GGUF stores it); the x16
# layout and ``amx_bf16_linear`` take the first three only.
QTYPE_CODES: dict[str, int] = {
    "q8_0": 0,
    "q4_0": 1,
    "q4_1": 2,
    "q4_k": 3,
    "q5_k": 4,
    "q6_k": 5,
}
# Instruction-set codes: "auto" picks the best one this CPU has.
ISA_CODES: dict[str, int] = {"auto": 0, "scalar": 1, "avx2": 2, "avx_vnni": 3, "avx512_vnni": 4}
# Weight byte layouts (kvserve/models/quant_layout.py): x16 runs on avx512_vnni, avx2 and scalar
# (and, for bf16 activations on AMX CPUs, in ``amx_bf16_linear``).
LAYOUT_CODES: dict[str, int] = {"plain": 0, "x16": 16}
X16_ISAS = ("avx512_vnni", "avx2", "scalar")

log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, object] = {}


def build_name() -> str:
    """Extension name: source, flags, torch version and CPU features hashed together."""
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.read_bytes())
    for part in (*native.cflags(), *native.LDFLAGS, torch.__version__, native.cpu_flags()):
        h.update(part.encode())
    return f"kvserve_quant_ops_{h.hexdigest()[:16]}"


def build_dir() -> Path:
    """Where the quantized kernels are built and kept (beside the other native kernels)."""
    return native.build_dir().parent / build_name()


def _register_fakes() -> None:
    for op in ("linear", "embedding", "amx_bf16_linear"):
        torch.library.register_fake(f"kvserve_quant::{op}")(lambda *args, **kwargs: None)


def _build(verbose: bool) -> None:
    what = "the quantized-weight kernels (~30 s)"
    native.build_extension(build_name(), SOURCES, build_dir(), what, verbose)
    _register_fakes()


def load(verbose: bool = False) -> bool:
    """Build (first time) and load the kernels; True when ``torch.ops.kvserve_quant`` has them."""
    return native.load_once(
        _state, _lock, lambda: _build(verbose), log, "quantized kernels unavailable"
    )


def available() -> bool:
    """Whether the quantized kernels are loaded (building them on the first call)."""
    return load()


def reason() -> str | None:
    """Why the kernels are unavailable (None when loaded or not tried yet)."""
    return _state.get("reason")  # type: ignore[return-value]


def supported_isas() -> list[str]:
    """The instruction sets this CPU can run the kernels with, best first (``scalar`` last)."""
    if not available():
        return []
    ops = torch.ops.kvserve_quant
    names = ["avx512_vnni", "avx_vnni", "avx2", "scalar"]
    return [n for n in names if ops.isa_supported(ISA_CODES[n])]


def best_isa() -> str:
    """The instruction set ``isa="auto"`` uses on this CPU."""
    code = int(torch.ops.kvserve_quant.best_isa())
    return next(name for name, c in ISA_CODES.items() if c == code)


def linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # uint8 [N, row_bytes]
    qtype: str,
    *,
    bias: torch.Tensor | None = None,  # float32 [N]
    out: torch.Tensor | None = None,  # [M, N], x's dtype, rows contiguous
    isa: str = "auto",
    layout: str = "plain",
) -> torch.Tensor:
    """``x @ dequant(weight)^T (+ bias)`` with the int8-dot kernels; returns ``out``."""
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    torch.ops.kvserve_quant.linear(
        out, x, weight, QTYPE_CODES[qtype], bias, ISA_CODES[isa], LAYOUT_CODES[layout]
    )
    return out


def amx_bf16_available() -> bool:
    """Whether ``amx_bf16_linear`` runs here (the build has AMX-BF16 and the kernel grants the
    tile state)."""
    return available() and bool(torch.ops.kvserve_quant.amx_bf16_supported())


def amx_bf16_linear(
    x: torch.Tensor,  # bf16 [M, K]
    weight: torch.Tensor,  # uint8 [N, row_bytes], x16 layout
    qtype: str,
    *,
    out: torch.Tensor | None = None,  # bf16 [M, N], rows contiguous
) -> torch.Tensor:
    """``x @ dequant(weight)^T`` on AMX bf16 tiles, the weight dequantized inside the GEMM
    (equal, bit for bit, to ``amx_linear`` on the dense bf16 copy); returns ``out``."""
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
    torch.ops.kvserve_quant.amx_bf16_linear(out, x, weight, QTYPE_CODES[qtype])
    return out


def embedding(
    ids: torch.Tensor,  # int64 [T]
    weight: torch.Tensor,  # uint8 [V, row_bytes]
    qtype: str,
    out: torch.Tensor,  # [T, K]
    layout: str = "plain",
) -> torch.Tensor:
    """Rows ``ids`` of the quantized table, dequantized into ``out``; returns ``out``."""
    torch.ops.kvserve_quant.embedding(out, ids, weight, QTYPE_CODES[qtype], LAYOUT_CODES[layout])
    return out
