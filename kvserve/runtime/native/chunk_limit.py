"""Start-up choice of which prefill chunks attend through the native decode kernel.

A chunk of n query tokens can attend two ways: ``TorchSDPABackend``'s (gather the context
into a contiguous copy, build a mask, one SDPA call) or the native decode kernel with each
query row as a decode query over the paged cache (``NativeCPUBackend``,
``AttentionMetadata.query_tables``). The kernel reads the context in place and has no
per-call set-up, so it wins on short chunks; SDPA's blocked matmuls may win on long ones,
by how much depends on the CPU and dtype. ``chunk_attention_limit`` times both on chunks of
16 .. ``max_tokens`` rows (each after an earlier chunk of its size, so with a context of
2n) and returns the longest chunk up to which the kernel was never the slower; the answer
is cached like the kernel selections (``kvserve.runtime.kernel_select``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from kvserve.config import ModelArchConfig
from kvserve.runtime.attention import AttentionMetadata, SeqSpec, build_attention_metadata
from kvserve.runtime.kernel_select import (
    cache_path,
    cpu_identity,
    machine_load,
    read_cached_value,
    write_cached_value,
)

log = logging.getLogger("kvserve")

PROBE_ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048)
BLOCK_SIZE = 16
CACHE_VERSION = 1

# timer(n, kernel) -> seconds of one layer's attention over a chunk of n rows.
ChunkTimer = Callable[[int, bool], float]


def probe_rows(max_tokens: int) -> list[int]:
    """The chunk sizes timed for a token budget of ``max_tokens``: PROBE_ROWS up to it, and
    the budget itself when it lies between."""
    rows = [n for n in PROBE_ROWS if n <= max_tokens]
    if max_tokens >= 1 and (not rows or rows[-1] < max_tokens < PROBE_ROWS[-1]):
        rows.append(max_tokens)
    return rows


def limit_from_timings(timings: dict[int, tuple[float, float]], max_tokens: int) -> int:
    """The longest chunk the kernel takes: rows up to the first probe at which it was slower
    than SDPA (``timings[n] = (kernel s, sdpa s)``); ``max_tokens`` when it never was."""
    limit = 0
    for n in sorted(timings):
        kernel, sdpa = timings[n]
        if kernel > sdpa:
            return limit
        limit = n
    return max_tokens if timings else 0


class ChunkAttentionProbe:
    """Times one layer's attention over a chunk of n rows at position n (context 2n), via
    the kernel or via SDPA, in ``dtype`` with ``arch``'s heads."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        from kvserve.runtime.native.backend import NativeCPUBackend

        self.arch, self.dtype = arch, dtype
        self.kernel = NativeCPUBackend(chunk_kernel_max_tokens=PROBE_ROWS[-1])
        self.sdpa = NativeCPUBackend(chunk_kernel_max_tokens=0)
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

    def __call__(self, n: int, kernel: bool) -> float:
        meta, cache, qkv = self._case(n)
        h, kvh = self.arch.num_attention_heads, self.arch.num_key_value_heads
        q, k, v = qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]
        backend = self.kernel if kernel else self.sdpa
        t = time.perf_counter()
        backend.forward(q, k, v, cache, meta)
        return time.perf_counter() - t


def chunk_attention_limit(
    arch: ModelArchConfig,
    dtype: torch.dtype,
    max_tokens: int,
    *,
    mode: str = "auto",
    timer: ChunkTimer | None = None,
    budget_s: float = 0.005,
) -> int:
    """The ``chunk_kernel_max_tokens`` for ``NativeCPUBackend`` on this CPU (see module doc).

    ``mode``: "off" -> 0 (every chunk through SDPA, the path before this choice existed);
    "auto" -> the cached answer, else measured; "measure" -> measured again. Each size is
    timed kernel and SDPA in alternation until each has had ``budget_s`` (at least 3 calls),
    best call kept.
    """
    if mode == "off" or max_tokens < 1:
        return 0
    rows = probe_rows(max_tokens)
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
    }
    path = cache_path(key).with_name("chunkattn_" + cache_path(key).name)
    load = machine_load()
    cached = None if mode == "measure" else read_cached_value(path, key, "limit", "chunk attn")
    if cached is not None:
        return int(cached)
    timer = timer or ChunkAttentionProbe(arch, dtype)
    timings: dict[int, tuple[float, float]] = {}
    for n in rows:
        best = [float("inf"), float("inf")]
        spent = [0.0, 0.0]
        for round_ in range(100):
            for j, kernel in enumerate((True, False)):
                dt = timer(n, kernel)
                best[j] = min(best[j], dt)
                spent[j] += dt
            if round_ >= 2 and min(spent) >= budget_s:
                break
        timings[n] = (best[0], best[1])
        if best[0] > best[1]:
            break  # the limit is found: longer chunks are not timed
    limit = limit_from_timings(timings, max_tokens)
    log.info(
        "chunk attention: the decode kernel up to %d rows, SDPA above (%s)",
        limit,
        ", ".join(f"{n}: {k * 1e6:.0f} vs {s * 1e6:.0f} us" for n, (k, s) in timings.items()),
    )
    write_cached_value(path, key, "limit", limit, load, "chunk attn")
    return limit
