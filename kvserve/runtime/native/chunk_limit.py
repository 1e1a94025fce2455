"""Start-up choice of which prefill chunks attend through the native decode kernel.

A chunk of n query tokens can attend two ways: ``TorchSDPABackend``'s (gather the context
into a contiguous copy, build a mask, one SDPA call) or the native decode kernel with each
query row as a decode query over the paged cache (``NativeCPUBackend``,
``AttentionMetadata.query_tables``). The kernel reads the context in place and has no
per-call set-up, so it wins on short chunks; SDPA's blocked matmuls may win on long ones,
by how much depends on the CPU and dtype. ``chunk_attention_limit`` times both on chunks of
16 .. ``max_tokens`` rows (each after an earlier chunk of its size, so with a context of
2n) and returns the longest chunk up to which the kernel was never the slower. For a
half-precision model SDPA is also timed in float32 (inputs converted, output converted
back): on a CPU without AMX its float32 kernels beat its bf16 ones (the Xeon without AMX,
2026-12-03, 2175cbf, 256-row chunk: 1.93-2.08 vs 2.32-2.45 ms), on others the reverse may hold;
the faster one at the size where the kernel lost serves the longer chunks. On an AMX CPU a bf16
model of head_dim 64 has a fourth way, ``kvserve::amx_prefill_attention`` (flash attention on
AMX tiles over the paged cache, no gathered copy), timed with the others: where it beats SDPA at
the size where the decode kernel lost, it serves the longer chunks. The answer is cached like
the kernel selections (``kvserve.runtime.autotune``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.config import ModelArchConfig
from kvserve.runtime.attention.metadata import AttentionMetadata, SeqSpec, build_attention_metadata
from kvserve.runtime.attention.native_cpu import (
    AMX_PREFILL_HEAD_DIM,
    NativeCPUBackend,
    amx_prefill_available,
)
from kvserve.runtime.autotune.cache import (
    cache_path,
    machine_load,
    read_cached_value,
    write_cached_value,
)
from kvserve.runtime.autotune.candidates import cpu_identity

log = logging.getLogger("kvserve")

PROBE_ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048)
BLOCK_SIZE = 16
CACHE_VERSION = 3  # 2: SDPA in float32 as a third way; 3: the AMX prefill kernel a fourth
WAYS = ("kernel", "sdpa", "sdpa_float32", "amx")

# timer(n, way) -> seconds of one layer's attention over a chunk of n rows, way in WAYS.
ChunkTimer = Callable[[int, str], float]


@dataclass(frozen=True, slots=True)
class ChunkAttention:
    """How prefill chunks attend: ``NativeCPUBackend``'s three settings."""

    max_kernel_tokens: int = 0  # chunks up to this many rows: the decode kernel
    sdpa_float32: bool = False  # longer ones: SDPA in float32 (half-precision models)
    amx: bool = False  # longer ones: the AMX prefill kernel where it serves them

    @classmethod
    def of(cls, backend: object) -> ChunkAttention | None:
        """The choice ``backend`` holds (None when it is not a ``NativeCPUBackend``)."""
        if not isinstance(backend, NativeCPUBackend):
            return None
        return cls(backend.chunk_kernel_max_tokens, backend.chunk_sdpa_float32, backend.chunk_amx)

    def apply(self, backend: NativeCPUBackend) -> None:
        """Set ``backend``'s chunk limit, SDPA dtype and AMX kernel choice to this choice."""
        backend.chunk_kernel_max_tokens = self.max_kernel_tokens
        backend.chunk_sdpa_float32 = self.sdpa_float32
        backend.chunk_amx = self.amx

    def summary(self) -> str:
        """One log line's worth."""
        sdpa = "SDPA in float32" if self.sdpa_float32 else "SDPA"
        above = (
            f"the AMX prefill kernel above ({sdpa} where it cannot serve)"
            if self.amx
            else (f"{sdpa} above")
        )
        return f"the decode kernel up to {self.max_kernel_tokens} rows, {above}"


# NOTE: batch-invariant attention: every query row, decode or prefill, through the paged decode
# kernel, whose result for a row depends on its own query and visible K/V only: scores over
# positions in order from 0, the softmax over the whole row, the V sum in position order, the
# same per-shape kernel whatever the batch (README of runtime/native, "Numerics"). SDPA and
# the AMX prefill kernel split a chunk's keys into tiles that start at the chunk, so a row's
# bits depended on where its prompt was cut (1.9e-5 on the final hidden state of the dense
# model, 40 tokens in 1 vs 2 chunks).
INVARIANT = ChunkAttention(max_kernel_tokens=(1 << 31) - 1)


def chunk_ways(arch: ModelArchConfig, dtype: torch.dtype) -> tuple[str, ...]:
    """The ways timed for a model of ``arch`` in ``dtype``: SDPA in float32 for a
    half-precision model, the AMX prefill kernel for a bf16 model of its head size where it
    runs (``amx_prefill_available``)."""
    ways = WAYS[:2] if dtype == torch.float32 else WAYS[:3]
    amx = dtype == torch.bfloat16 and arch.head_dim == AMX_PREFILL_HEAD_DIM
    return (*ways, "amx") if amx and amx_prefill_available() else ways


def probe_rows(max_tokens: int) -> list[int]:
    """The chunk sizes timed for a token budget of ``max_tokens``: PROBE_ROWS up to it, and
    the budget itself when it lies between."""
    rows = [n for n in PROBE_ROWS if n <= max_tokens]
    if max_tokens >= 1 and (not rows or rows[-1] < max_tokens < PROBE_ROWS[-1]):
        rows.append(max_tokens)
    return rows


def choice_from_timings(timings: dict[int, dict[str, float]], max_tokens: int) -> ChunkAttention:
    """The decode kernel up to the first probe at which it was slower than the faster SDPA
    way (``timings[n][way]`` seconds; all probes: ``max_tokens``); SDPA in float32 when it
    was timed and faster at that probe, and the AMX kernel for the longer chunks when it was
    timed and faster than both SDPA ways there.

    NOTE: the AMX kernel never takes chunks the decode kernel would keep, even where it
    attends them faster: a step whose every row goes through the decode kernel runs all its
    layers in one native call (``kvserve::decode_layers``), a saving per step that one
    layer's attention timing does not see (the embedded model: 25 us a layer for 16 rows
    against the decode kernel's 33, i.e. 0.24 ms a step, against a step run layer by layer).
    """
    limit = 0
    for n in sorted(timings):
        t = timings[n]
        sdpa = min(t.get("sdpa", float("inf")), t.get("sdpa_float32", float("inf")))
        if t["kernel"] > sdpa:
            float32 = t.get("sdpa_float32", float("inf")) < t.get("sdpa", float("inf"))
            return ChunkAttention(limit, float32, t.get("amx", float("inf")) < sdpa)
        limit = n
    return ChunkAttention(max_tokens if timings else 0, False)


class ChunkAttentionProbe:
    """Times one layer's attention over a chunk of n rows at position n (context 2n), one of
    ``WAYS``, in ``dtype`` with ``arch``'s heads."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        self.arch, self.dtype = arch, dtype
        self.backends = {
            "kernel": NativeCPUBackend(chunk_kernel_max_tokens=PROBE_ROWS[-1]),
            "sdpa": NativeCPUBackend(),
            "sdpa_float32": NativeCPUBackend(chunk_sdpa_float32=True),
            "amx": NativeCPUBackend(chunk_amx=True),
        }
        # n -> (metadata, cache [2, blocks, block_size, kvh, d], qkv [n, H + 2 kvh, d])
        self._cases: dict[int, tuple[AttentionMetadata, torch.Tensor, torch.Tensor]] = {}

    def _case(self, n: int) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        if n not in self._cases:
            a = self.arch
            blocks = -(-2 * n // BLOCK_SIZE)
            shape = (2, blocks, BLOCK_SIZE, a.num_key_value_heads, a.head_dim)
            heads = a.num_attention_heads + 2 * a.num_key_value_heads
            meta = build_attention_metadata(
                [SeqSpec(0, n, n, list(range(blocks)))],
                block_size=BLOCK_SIZE,
                device=torch.device("cpu"),
                dtype=self.dtype,
            )
            self._cases[n] = (
                meta,
                torch.empty(shape, dtype=self.dtype).uniform_(-1, 1),
                torch.randn(n, heads, a.head_dim).to(self.dtype),
            )
        return self._cases[n]

    def __call__(self, n: int, way: str) -> float:
        meta, cache, qkv = self._case(n)
        h, kvh = self.arch.num_attention_heads, self.arch.num_key_value_heads
        q, k, v = qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]
        backend = self.backends[way]
        t = time.perf_counter()
        backend.forward(q, k, v, cache, meta)
        return time.perf_counter() - t


def configure_backend(
    backend: object,
    arch: ModelArchConfig,
    dtype: torch.dtype,
    max_tokens: int,
    *,
    mode: str,
    device: str | torch.device,
    batch_invariant: bool = False,
) -> None:
    """Give a ``NativeCPUBackend`` on CPU its measured chunk choice
    (``chunk_attention_limit``), or, ``batch_invariant``, every row through the decode kernel
    (``INVARIANT``); any other backend or device is left as it is."""
    if isinstance(backend, NativeCPUBackend) and torch.device(device).type == "cpu":
        if batch_invariant:
            INVARIANT.apply(backend)
            return
        chunk_attention_limit(arch, dtype, max_tokens, mode=mode).apply(backend)


def chunk_attention_limit(
    arch: ModelArchConfig,
    dtype: torch.dtype,
    max_tokens: int,
    *,
    mode: str = "auto",
    timer: ChunkTimer | None = None,
    budget_s: float = 0.005,
) -> ChunkAttention:
    """How chunks attend on this CPU, for ``NativeCPUBackend`` (see module doc).

    ``mode``: "off" -> every chunk through SDPA in the model's dtype (the path before this
    choice existed); "auto" -> the cached answer, else measured; "measure" -> measured
    again. Each size is timed every way in turn until each has had ``budget_s`` (at least 3
    calls), best call kept; timing stops at the first size where the kernel loses.
    """
    if mode == "off" or max_tokens < 1:
        return ChunkAttention()
    rows = probe_rows(max_tokens)
    ways = chunk_ways(arch, dtype)
    model, flags = cpu_identity()
    key = {
        "what": "chunk_attention_limit",
        "version": CACHE_VERSION,
        "cpu": model,
        "cpu_flags": flags,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype),
        "heads": [arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim],
        "rows": rows,
        "ways": list(ways),  # NOTE: an emulated kind's build may lack the AMX kernel
    }
    path = cache_path(key).with_name("chunkattn_" + cache_path(key).name)
    load = machine_load()
    cached = None if mode == "measure" else read_cached_value(path, key, "choice", "chunk attn")
    if cached is not None:
        return ChunkAttention(int(cached[0]), bool(cached[1]), bool(cached[2]))
    timer = timer or ChunkAttentionProbe(arch, dtype)
    timings: dict[int, dict[str, float]] = {}
    for n in rows:
        best = dict.fromkeys(ways, float("inf"))
        spent = dict.fromkeys(ways, 0.0)
        for round_ in range(100):
            for way in ways:
                dt = timer(n, way)
                best[way] = min(best[way], dt)
                spent[way] += dt
            if round_ >= 2 and min(spent.values()) >= budget_s:
                break
        timings[n] = best
        if best["kernel"] > min(v for w, v in best.items() if w.startswith("sdpa")):
            break  # the limit is found: longer chunks are not timed
    choice = choice_from_timings(timings, max_tokens)
    log.info(
        "chunk attention: %s (us a layer by rows, %s: %s)",
        choice.summary(),
        " / ".join(ways),
        ", ".join(
            f"{n}: " + " / ".join(f"{t[w] * 1e6:.0f}" for w in ways) for n, t in timings.items()
        ),
    )
    value = [choice.max_kernel_tokens, choice.sdpa_float32, choice.amx]
    write_cached_value(path, key, "choice", value, load, "chunk attn")
    return choice
