"""Measure the dtypes: how much faster a decode step's matmuls and attention run in bf16 than
in fp32 (``dtype_speedup``), each dtype with its chosen kernels, timed in alternation; what
``--dtype auto`` decides on (``tune.choose_kernels``).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.config import ModelArchConfig
from kvserve.runtime.autotune.cache import (
    cache_path,
    machine_load,
    read_cached_value,
    write_cached_value,
)
from kvserve.runtime.autotune.candidates import (
    QuantizedProjections,
    build_linear,
    cpu_identity,
    projection_shapes,
)
from kvserve.runtime.autotune.choose import Selection
from kvserve.runtime.linear import Linear

# The decode buckets whose matmul time decides ``auto`` (B=1 .. 32 decoding).
DECIDING_BOUNDS = (1, 8, 32)
# The context (tokens a sequence) at which the decision times decode attention: the middle
# of the 128+128 benchmark trace's contexts, below the ShareGPT-like trace's median (444).
DECIDING_CONTEXT = 256


def dtype_speedup(
    arch: ModelArchConfig,
    fp32: Selection,
    bf16: Selection,
    *,
    device: torch.device,
    mode: str = "auto",
    quantized: QuantizedProjections | None = None,
    timer: Callable[[Linear, torch.Tensor, torch.Tensor], float] | None = None,
    attention_timer: Callable[[torch.dtype, int], float] | None = None,
    budget_s: float = 0.010,
    passes: int = 2,
) -> float:
    """fp32 time / bf16 time of a decode step's matmuls and attention (M = 1, 8, 32; each
    dtype with its chosen kernels), cached like the selections (``mode`` "measure": measured
    again).

    ``quantized``'s shapes run random weights of their format and layout through the plan's
    quantized methods (the selections then hold those choices), the others dense weights.
    The attention term is one layer's paged decode attention over ``M`` sequences of
    ``DECIDING_CONTEXT`` tokens, times the layers (``attention_timer(dtype, M)``: seconds a
    call; default ``DecodeAttentionProbe``, present where the native kernels load).

    NOTE: the two dtypes are timed in alternation in one run, never taken from two selections
    measured at different times: on a shared machine those can be minutes and loads apart.
    NOTE: why attention counts, and quantized shapes as they run. On a Xeon without AMX
    (AVX512_BF16; 2026-12-03, e081805) dense bf16 matmuls ran 0.96x fp32, so the matmul-only rule
    chose fp32 for a GGUF whose int8-dot kernels run bf16 activations at least as fast (Q4_1
    sequence at M=32: 15.1 ms fp32, 10.6 bf16) and whose B=32 decode attention at 256 tokens
    took 19-20 ms a step in fp32 against 12-14 in bf16 (a bf16 cache halves the bytes read;
    docs/kernels-rationale.md, section 3).
    """
    if attention_timer is None and device.type == "cpu":
        attention_timer = DecodeAttentionProbe.if_available(arch)
    counts = projection_shapes(arch)
    formats = dict(quantized.formats) if quantized is not None else {}
    model, flags = cpu_identity()
    key = {
        "what": "dtype_speedup",
        "version": 2,  # 2: attention term, quantized shapes
        "cpu": model,
        "cpu_flags": flags,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": device.type,
        "shapes": sorted([*s, n] for s, n in counts.items()),
        "quantized": sorted([*s, *f] for s, f in formats.items()),
        "attention": DECIDING_CONTEXT if attention_timer is not None else None,
        "plans": [repr(sorted(fp32.plan.items())), repr(sorted(bf16.plan.items()))],
    }
    path = cache_path(key).with_name("dtype_" + cache_path(key).name)
    load = machine_load()
    cached = read_cached_value(path, key, "speedup", "dtype") if mode != "measure" else None
    if cached is not None:
        return float(cached)
    cells = _decode_cells(arch, fp32, bf16, quantized, device, timer or _time_linear)
    if attention_timer is not None:
        for m in DECIDING_BOUNDS:
            calls = [functools.partial(attention_timer, dt, m) for dt in (fp32.dtype, bf16.dtype)]
            cells.append((arch.num_hidden_layers, calls))
    best = [[float("inf"), float("inf")] for _ in cells]
    for _ in range(passes):
        for i, (_n, calls) in enumerate(cells):
            spent = [0.0, 0.0]
            for round_ in range(200):
                for j, call in enumerate(calls):
                    dt = call()
                    best[i][j] = min(best[i][j], dt)
                    spent[j] += dt
                if round_ >= 4 and min(spent) >= budget_s:
                    break
    t32 = sum(n * b[0] for (n, _), b in zip(cells, best, strict=True))
    t16 = sum(n * b[1] for (n, _), b in zip(cells, best, strict=True))
    speedup = t32 / t16 if t16 > 0 else float("inf")
    write_cached_value(path, key, "speedup", speedup, load, "dtype")
    return speedup


def _decode_cells(
    arch: ModelArchConfig,
    fp32: Selection,
    bf16: Selection,
    quantized: QuantizedProjections | None,
    device: torch.device,
    time_call: Callable[[Linear, torch.Tensor, torch.Tensor], float],
) -> list[tuple[int, list[Callable[[], float]]]]:
    """(count, [fp32 call, bf16 call]) per projection shape and deciding M: each call times
    one product of the shape's ``Linear`` in that dtype (seconds)."""
    gen = torch.Generator().manual_seed(2)
    cells: list[tuple[int, list[Callable[[], float]]]] = []
    for shape, n in projection_shapes(arch).items():
        w = torch.randn(shape[1], shape[0], generator=gen).t() * 0.02  # the model's layout
        source: object = w
        if quantized is not None and shape in quantized.formats:
            qtype, layout = quantized.formats[shape]
            source = quantized.make_source(w.contiguous(), qtype, layout)
        pair = []
        for sel in (fp32, bf16):
            choice = sel.plan.get(shape) if sel.source != "off" else None
            weight = w.to(sel.dtype) if isinstance(source, torch.Tensor) else source
            pair.append(build_linear(weight, act_dtype=sel.dtype, device=device, choice=choice))
        for m in DECIDING_BOUNDS:
            x = torch.randn(m, shape[1], generator=gen)
            calls: list[Callable[[], float]] = [
                functools.partial(
                    time_call, lin, x.to(sel.dtype), x.new_empty(m, shape[0], dtype=sel.dtype)
                )
                for sel, lin in zip((fp32, bf16), pair, strict=True)
            ]
            cells.append((n, calls))
    return cells


@dataclass(slots=True)
class _AttentionCase:
    caches: list[torch.Tensor]  # copies of [2, num_blocks, block_size, kvh, d]
    q: torch.Tensor  # [B, H, d]
    out: torch.Tensor  # [B, H, d]
    tables: torch.Tensor  # int32 [B, blocks a sequence]
    lens: torch.Tensor  # int32 [B]
    next_copy: int = 0


class DecodeAttentionProbe:
    """Times one layer's paged decode attention (the native kernel) per dtype and batch.

    ``probe(dtype, batch)``: seconds of one call over ``batch`` sequences of ``context``
    tokens. Each call reads another copy of the cache (at least 32 MiB of copies, at most
    16), so the K/V come from memory as after a step's weight stream.
    """

    MIN_COPY_BYTES = 32 << 20

    def __init__(
        self, arch: ModelArchConfig, context: int = DECIDING_CONTEXT, block_size: int = 16
    ) -> None:
        self.arch, self.context, self.block_size = arch, context, block_size
        self._cases: dict[tuple[torch.dtype, int], _AttentionCase] = {}

    @staticmethod
    def if_available(arch: ModelArchConfig) -> DecodeAttentionProbe | None:
        """A probe where the native kernels load (the model's decode path), else None."""
        from kvserve.runtime import native

        return DecodeAttentionProbe(arch) if native.available() else None

    def _case(self, dtype: torch.dtype, batch: int) -> _AttentionCase:
        a, bs = self.arch, self.block_size
        per_seq = -(-self.context // bs)
        shape = (2, batch * per_seq, bs, a.num_key_value_heads, a.head_dim)
        nbytes = math.prod(shape) * dtype.itemsize
        copies = max(1, min(16, -(-self.MIN_COPY_BYTES // nbytes)))
        q = torch.randn(batch, a.num_attention_heads, a.head_dim).to(dtype)
        return _AttentionCase(
            caches=[torch.empty(shape, dtype=dtype).uniform_(-1, 1) for _ in range(copies)],
            q=q,
            out=torch.empty_like(q),
            tables=torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq),
            lens=torch.full((batch,), self.context, dtype=torch.int32),
        )

    def __call__(self, dtype: torch.dtype, batch: int) -> float:
        from kvserve.runtime import native

        case = self._cases.get((dtype, batch))
        if case is None:
            case = self._cases[(dtype, batch)] = self._case(dtype, batch)
        cache = case.caches[case.next_copy]
        case.next_copy = (case.next_copy + 1) % len(case.caches)
        scale = 1.0 / math.sqrt(case.q.shape[-1])
        t = time.perf_counter()
        native.ops().paged_decode_attention(
            case.out, case.q, cache, case.tables, case.lens, scale, 0, 0
        )
        return time.perf_counter() - t


def _time_linear(lin: Linear, x: torch.Tensor, out: torch.Tensor) -> float:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    t = time.perf_counter()
    lin(x, out)
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - t
