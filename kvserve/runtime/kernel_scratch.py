"""Kernel scratch: memory that kernels take for themselves, invisible to the activation trace.

The activation plan (``memory_plan/recorder.py``) records every tensor an aten op returns; it cannot
see the buffers an op allocates inside its kernel and frees before returning, nor the ones a
BLAS library keeps for itself. On the embedded model (fp32, 2 threads) those were the bytes
a real step used beyond the plan (``kvserve bench memory --measure``), of two kinds:

- **CPU flash attention** (``aten._scaled_dot_product_flash_attention_for_cpu``): per-thread
  buffers for one q-block x kv-block of scores, the running max/sum and one output block,
  allocated at each call and freed at its end (16-bit inputs on AMX CPUs also get a packed
  copy of K and V). Exact from the ATen source (``FlashAttentionKernel.cpp``) and checked
  against the torch profiler's allocations in ``tests/runtime/test_kernel_scratch.py``:
  :func:`sdpa_cpu_flash_scratch_bytes`. Modelled per op: the planner adds it as a buffer
  live only at that op, so the arena places it next to the op's inputs and outputs.
  1.1 MiB for a 2048-token chunk with 2 threads.
- **Native decode attention** (``kvserve::paged_decode_attention``, our own kernel): per
  thread one float buffer for a task's scores ``[heads, context]`` and its queries and
  accumulators ``[heads, 2 * head_dim]``, and the line stream's runs (a few per block of the
  block table), kept for the call: :func:`native_decode_scratch_bytes` (exact from
  native/csrc/decode_attention.cpp, bounded by the block table's width). 0.4 MiB per thread for
  the embedded model at 8,192 tokens (block size 16).
- **GEMM library buffers** (MKL's packing buffers behind ``aten.mm``): sized by the
  library's own blocking, per thread and per shape, and then kept by the library across
  calls (its memory manager caches them), so they are a fixed cost once the largest step
  has run. Closed source, so not modelled: :func:`measure_gemm_scratch` runs each distinct
  GEMM shape of the planned steps once and measures what that added to the process (RSS on
  CPU, allocated bytes on CUDA). Measured in fresh processes: 13 MB for the logits GEMM
  [64, 576] x [576, 49152] with 2 threads (about its output's size; under 1 MB with one
  thread), 2-5 MB for each [512+, 576] x [576, n] layer GEMM.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

_REDUCED = (torch.bfloat16, torch.float16)


def _could_pack(dtype: torch.dtype) -> bool:
    """Whether ATen's ``cpublas::could_pack`` holds: oneDNN packs this dtype on AMX CPUs."""
    probe = {torch.bfloat16: "_is_amx_tile_supported", torch.float16: "_is_amx_fp16_supported"}
    name = probe.get(dtype)
    if name is None:
        return False
    # NOTE: on an AMX CPU, a oneDNN cap below AMX (ONEDNN_MAX_CPU_ISA=AVX2 or AVX512_CORE_BF16:
    # how another CPU kind's paths are run here) turns the packing off (measured).
    isa_cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL"
    if "AMX" not in isa_cap.upper() and isa_cap.upper() not in ("ALL", "DEFAULT"):
        return False
    check = getattr(torch.cpu, name, None)
    return bool(check()) if check is not None else True  # unknown: assume it packs (bound)


def sdpa_cpu_flash_scratch_bytes(
    query_shape: Sequence[int],  # [B, H, Lq, d] as passed to the op
    key_shape: Sequence[int],  # [B, Hk, Lk, d]
    dtype: torch.dtype,
    num_threads: int,
    *,
    is_causal: bool = False,
    could_pack: bool | None = None,
) -> int:
    """Bytes the CPU flash-attention kernel allocates for itself during one call.

    As ATen's ``cpu_flash_attention`` (torch 2.13): per thread, a ``qSplit x kvSplit`` score
    block, the row max and sum and a ``qSplit x d`` output block in the accumulation dtype
    (float32 below float64); 16-bit inputs add a per-thread ``qSplit x kvSplit`` block of
    their own dtype. Split sizes follow the query length: 256 x 512 from 768 query rows,
    64 x 512 from 192, else 32 x 512 (each capped by the lengths). Where oneDNN can pack the
    dtype (``could_pack``; default: asked of torch, AMX CPUs) and the call is large enough,
    K and V are also repacked whole, with a per-thread transpose block. The ``logsumexp``
    output is not scratch (the op returns it, so the trace sees it).
    """
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    batch, num_heads, q_len, head_dim = (int(x) for x in query_shape)
    num_kv_heads, kv_len = int(key_shape[1]), int(key_shape[2])
    q_split = min(256 if q_len >= 768 else 64 if q_len >= 192 else 32, q_len)
    kv_split = min(512, kv_len)
    accum_bytes = 8 if dtype == torch.float64 else 4
    elem_bytes = torch.empty(0, dtype=dtype).element_size()
    reduced = dtype in _REDUCED
    pack = False
    if reduced and (could_pack if could_pack is not None else _could_pack(dtype)):
        is_bf16 = dtype == torch.bfloat16
        thresh = 64 if is_bf16 else 16
        if q_len >= thresh and kv_len >= thresh:
            q_slices = -(-q_len // q_split)
            pack_size = batch * num_kv_heads * kv_len * head_dim
            qs_per_thread = -(-(batch * num_heads * q_slices) // num_threads)
            keys = min(q_len, kv_len) if is_causal else kv_len
            gemm_size = qs_per_thread * q_split * keys * head_dim
            pack = gemm_size / pack_size >= (4 if is_bf16 else 1)
    e_head = head_dim + head_dim % 2 if pack else head_dim
    e_kv_split = kv_split + kv_split % 2 if pack else kv_split
    total = num_threads * (q_split * kv_split + 2 * q_split + q_split * head_dim) * accum_bytes
    if reduced:
        total += num_threads * q_split * e_kv_split * elem_bytes
    if pack:
        kv_tail = (kv_len - 1) % kv_split + 1
        kv_padding = (kv_len - 1) // kv_split * e_kv_split + kv_tail + kv_tail % 2
        total += batch * num_kv_heads * (e_head * kv_len + kv_padding * head_dim) * elem_bytes
        total += num_threads * kv_split * head_dim * elem_bytes  # transpose block
        if head_dim % 2:
            total += num_threads * q_split * e_head * elem_bytes  # padded query block
    return total


# sizeof(LineStream::Run) in native/csrc/attention/paged_kv.h: a pointer and three int64s.
_LINE_RUN_BYTES = 32


def native_decode_scratch_bytes(
    num_heads: int, max_context: int, head_dim: int, num_threads: int, max_blocks: int
) -> int:
    """Most bytes ``kvserve::paged_decode_attention`` holds during one call.

    Each thread's tasks share one ``std::vector<float>`` sized for a task's query heads
    (at most all ``num_heads`` of a sequence) times ``context + 2 * head_dim`` (scores, then
    float queries and accumulators); ``max_context`` bounds the context (the block table's
    width in tokens). Each thread's line stream (``LineStream``, on AVX-512 and AVX2 CPUs) holds the
    runs of two tasks and builds a third's, up to ``2 * (max_blocks + 1)`` runs of 32 bytes
    each (``max_blocks``: the block table's width).
    """
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    stream = 3 * 2 * (max_blocks + 1) * _LINE_RUN_BYTES
    return num_threads * (num_heads * (max_context + 2 * head_dim) * 4 + stream)


# bf16 bytes native/csrc/amx_attention.cpp packs per KV head and 32-key step (K rows and V^T, 32
# keys x 64 dims each), and its per-thread TaskScratch (Q^T, two steps' S^T and P^T, an O^T
# tile).
_AMX_PREFILL_STEP_BYTES = 2 * 32 * 64 * 2
_AMX_PREFILL_TASK_BYTES = 2 * 512 * 2 + 2 * 32 * 16 * 4 + 2 * 512 * 2 + 16 * 16 * 4


def amx_prefill_scratch_bytes(num_kv_heads: int, context: int, num_threads: int) -> int:
    """Most bytes ``kvserve::amx_prefill_attention`` holds during one call over ``context``
    keys: the keys packed per KV head on the calling thread (plus 64 bytes of alignment) and
    each thread's task buffers."""
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    steps = -(-context // 32)
    return (
        num_kv_heads * steps * _AMX_PREFILL_STEP_BYTES + 64 + num_threads * _AMX_PREFILL_TASK_BYTES
    )


@dataclass(frozen=True, slots=True, order=True)
class GemmShape:
    """One matrix product ``[m, k] @ [k, n]``; ``b_transposed``: B is the transpose of a
    contiguous ``[n, k]`` matrix (column-major), which the BLAS treats as another layout."""

    m: int
    k: int
    n: int
    dtype: str  # torch dtype name, e.g. "float32"
    b_transposed: bool


def _b_key(b: torch.Tensor) -> tuple[int, int, str, bool]:
    """(k, n, dtype name, column-major) of a 2-D right operand ``b`` [k, n]."""
    column_major = b.stride(0) == 1 and b.stride(1) != 1
    return int(b.shape[0]), int(b.shape[1]), str(b.dtype).removeprefix("torch."), column_major


def gemm_shape(a: torch.Tensor, b: torch.Tensor) -> GemmShape | None:
    """The GemmShape of ``a @ b`` for 2-D operands (None otherwise)."""
    if a.dim() != 2 or b.dim() != 2:
        return None
    k, n, dtype, column_major = _b_key(b)
    return GemmShape(int(a.shape[0]), k, n, dtype, column_major)


def resident_bytes() -> int | None:
    """The process's resident set size, from /proc (None where there is none)."""
    try:
        with open("/proc/self/statm") as fh:
            resident_pages = int(fh.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def measure_gemm_scratch(
    shapes: Sequence[GemmShape],
    *,
    device: str | torch.device = "cpu",
    b_operands: Iterable[torch.Tensor] = (),
) -> int | None:
    """Bytes the GEMM library kept after running each of ``shapes`` once (None: unmeasurable).

    Operands and outputs are allocated and written before the first reading, so only what
    the library added counts: resident bytes on the CPU, allocated bytes on CUDA (cuBLAS
    workspaces come from torch's allocator). ``b_operands``: existing ``[k, n]`` tensors
    (e.g. the model's weights as ``w.t()``), used as B where shape, dtype and layout match
    instead of a temporary of that size. Buffers the library frees within a call are not
    seen; on the CPU the ones it keeps (MKL keeps them) are what a long run holds.
    """
    device = torch.device(device)
    if not shapes:
        return 0
    existing: dict[tuple[int, int, str, bool], torch.Tensor] = {}
    for b in b_operands:
        same_device = b.device.type == device.type and device.index in (None, b.device.index)
        if b.dim() == 2 and same_device:
            existing.setdefault(_b_key(b), b)
    operands = []
    for s in sorted(set(shapes)):
        dtype = getattr(torch, s.dtype)
        a = torch.ones(s.m, s.k, dtype=dtype, device=device)  # [m, k]
        b = existing.get((s.k, s.n, s.dtype, s.b_transposed))
        if b is None and s.b_transposed:
            b = torch.ones(s.n, s.k, dtype=dtype, device=device).t()  # [k, n] column-major
        elif b is None:
            b = torch.ones(s.k, s.n, dtype=dtype, device=device)  # [k, n]
        out = torch.ones(s.m, s.n, dtype=dtype, device=device)  # [m, n]
        operands.append((a, b, out))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = resident_bytes()
        if before is None:
            return None
    with torch.inference_mode():
        for a, b, out in operands:
            torch.mm(a, b, out=out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        after = torch.cuda.memory_allocated(device)
    else:
        after = resident_bytes()
        assert after is not None
    return max(after - before, 0)


__all__ = [
    "GemmShape",
    "gemm_shape",
    "resident_bytes",
    "measure_gemm_scratch",
    "native_decode_scratch_bytes",
    "sdpa_cpu_flash_scratch_bytes",
]
