"""Start-up choice of the model dtype (``--dtype auto``) and of the projection kernels.

``choose_dtype_and_kernels(config, arch, quantized, counts)`` turns ``config.dtype`` into a torch
dtype: on CUDA ``auto`` is bfloat16 (float16 without bf16 support); on CPU it is bfloat16 only
where the CPU has native bf16 arithmetic (AMX or AVX512_BF16) *and* a decode step's matmuls
and attention (each dtype with its chosen kernels, timed in alternation: ``dtype_speedup``)
run faster in bf16; else float32. An explicit ``bfloat16`` on a CPU without native bf16 runs,
with a warning giving the measured slowdown.

With the dtype it measures (or reads from the cache) the fastest ``LinearMethod`` per
projection shape and M bucket: ``select_shapes`` for the dense shapes
(``kvserve.runtime.kernel_select``), ``quant_select.quantized_selection`` for the quantized
ones. A model whose weights load quantized is chosen for after the load
(``pending_choice``), when its quantized shapes are known.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch

from kvserve.config import ModelArchConfig
from kvserve.engine.config import EngineConfig
from kvserve.runtime.kernel_cache import (
    cache_path,
    cpu_flags,
    cpu_identity,
    machine_load,
    read_cached_value,
    write_cached_value,
)
from kvserve.runtime.kernel_select import DECODE_BOUNDS, Selection, select_kernels
from kvserve.runtime.linear import Linear, build_linear

log = logging.getLogger("kvserve")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
# The decode buckets whose matmul time decides ``auto`` (B=1 .. 32 decoding).
_DECIDING_BOUNDS = (1, 8, 32)
# The context (tokens a sequence) at which the decision times decode attention: the middle
# of the 128+128 benchmark trace's contexts, below the ShareGPT-like trace's median (444).
DECIDING_CONTEXT = 256


def projection_shapes(arch: ModelArchConfig) -> dict[tuple[int, int], int]:
    """(out, in) of every projection weight -> how many a decode step runs (layers; lm_head 1)."""
    h, d = arch.hidden_size, arch.head_dim
    q = arch.num_attention_heads * d
    kv = arch.num_key_value_heads * d
    counts: dict[tuple[int, int], int] = {}
    for shape in (
        (q + 2 * kv, h),
        (h, q),
        (2 * arch.intermediate_size, h),
        (h, arch.intermediate_size),
    ):
        counts[shape] = counts.get(shape, 0) + arch.num_hidden_layers
    head = (arch.vocab_size, h)
    counts[head] = counts.get(head, 0) + 1
    return counts


def native_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (AMX-BF16 or AVX512_BF16)."""
    flags = set(cpu_flags().split())
    return bool(flags & {"amx_bf16", "avx512_bf16"})


@dataclass(frozen=True)
class KernelChoice:
    """The dtype chosen and the kernel selection for it (plus a line saying why)."""

    dtype: torch.dtype
    selection: Selection
    reason: str
    # The dtype asked for ("auto" or a name) while the choice waits for the model's quantized
    # projections (``pending_choice``); ``dtype`` is then the one to load the weights in.
    pending: str | None = None

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def short(self) -> str:
        """The dtype (and why) and where the kernel choice came from, in a few words."""
        how = {"off": "selection off", "cache": "from cache"}.get(self.selection.source, "measured")
        return f"dtype {self.dtype_name} ({self.reason}); kernels {how}"

    def summary(self) -> str:
        """The start-up line: dtype (and why), then the kernels."""
        return f"dtype {self.dtype_name} ({self.reason}); {self.selection.summary()}"


def pending_choice(config: EngineConfig) -> KernelChoice:
    """The choice for a model whose quantized projections are not read yet: nothing measured,
    the weights to load in the requested dtype (float32 for ``auto``, cast once decided); the
    loader then calls ``choose_dtype_and_kernels`` with the projections it holds quantized.

    NOTE: the dense selection times only the shapes that stay dense. Measured before the
    load, it timed every projection shape densely in both dtypes (and checked each plan on
    passes holding up to 768 MB of copies), for a model whose projections all run quantized:
    12 s of a 41 s first start-up of the embedded model on the AMX Xeon
    (``bench/results/session31/cold_start.txt``).
    """
    dtype = torch.float32 if config.dtype == "auto" else DTYPES[config.dtype]
    selection = Selection(dtype, {}, source="off" if config.kernel_selection == "off" else "cache")
    return KernelChoice(dtype, selection, "pending", pending=config.dtype)


def select_shapes(
    config: EngineConfig,
    arch: ModelArchConfig,
    dtype: torch.dtype,
    mode: str,
    quantized: Collection[tuple[int, int]] = (),
) -> Selection:
    """The dense selection for the projection shapes outside ``quantized`` (those run their
    own kernels, ``_with_quantized``): an empty plan when every shape is quantized."""
    counts = {s: n for s, n in projection_shapes(arch).items() if s not in quantized}
    if not counts:
        return Selection(dtype, {}, source="off" if mode == "off" else "cache")
    return select_kernels(
        counts,
        act_dtype=dtype,
        device=config.device,
        mode=mode,
        counts=counts,
        # NOTE: the lm_head runs on the sampled rows only: measured up to the decode sizes.
        max_rows={(arch.vocab_size, arch.hidden_size): DECODE_BOUNDS[-1]},
    )


def decode_matmul_seconds(sel: Selection, arch: ModelArchConfig) -> float:
    """Measured matmul seconds of decode steps at M = 1, 8 and 32 (summed), chosen kernels."""
    return sel.total_seconds(_DECIDING_BOUNDS, projection_shapes(arch))


def choose_dtype_and_kernels(
    config: EngineConfig,
    arch: ModelArchConfig,
    quantized: Mapping[tuple[int, int], tuple[str, str]] | None = None,
    counts: Mapping[tuple[int, int], int] | None = None,
) -> KernelChoice:
    """Resolve ``config.dtype`` (see the module docstring) and select the kernels for it.

    ``quantized``: the projections the model holds quantized, (out, in) -> (format, layout)
    (``quant_select.quantized_formats``). They run their own kernel selection per dtype, which
    ``auto`` times as they run, and the dense selection covers only the other shapes; the
    choice's selection holds both, so it is the model's whole plan. ``counts``: the calls a
    decode step makes of each quantized shape (``quant_select.quantized_counts``; default
    every layer's, ``projection_shapes``).
    """
    device = torch.device(config.device)
    mode = config.kernel_selection
    formats = dict(quantized or {})
    steps = dict(counts) if counts is not None else projection_shapes(arch)

    def select(dtype: torch.dtype, how: str) -> Selection:
        dense = select_shapes(config, arch, dtype, how, formats.keys())
        return _with_quantized(dense, formats, steps, arch, device, how)

    if config.dtype != "auto":
        dtype = DTYPES[config.dtype]
        if device.type == "cpu" and dtype == torch.bfloat16 and not native_bf16():
            probe = "auto" if mode == "off" else mode
            fp32, bf16 = select(torch.float32, probe), select(dtype, probe)
            speedup = dtype_speedup(
                arch, fp32, bf16, device=device, mode=mode, quantized=formats or None
            )
            log.warning(
                "dtype bfloat16 on a CPU without native bf16 (no AMX / AVX512_BF16): decode "
                "matmuls and attention measured %.2fx the time of float32",
                1.0 / speedup,
            )
        return KernelChoice(dtype, select(dtype, mode), "requested")
    if device.type == "cuda":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return KernelChoice(dtype, select(dtype, mode), "auto: CUDA")
    if not native_bf16():
        return KernelChoice(torch.float32, select(torch.float32, mode), "auto: no native bf16")
    # NOTE: the decision needs timings even with selection off: measure (or read the cache)
    # for the decision, then use the requested mode's selection for the chosen dtype.
    probe = "auto" if mode == "off" else mode
    fp32, bf16 = select(torch.float32, probe), select(torch.bfloat16, probe)
    ratio = dtype_speedup(arch, fp32, bf16, device=device, mode=probe, quantized=formats or None)
    dtype, sel = (torch.bfloat16, bf16) if ratio > 1.0 else (torch.float32, fp32)
    if mode == "off":
        sel = select(dtype, "off")
    what = "quantized matmuls" if formats else "matmuls"
    reason = f"auto: native bf16, decode {what} + attention bf16 {ratio:.2f}x fp32 speed"
    return KernelChoice(dtype, sel, reason)


def _with_quantized(
    sel: Selection,
    quantized: Mapping[tuple[int, int], tuple[str, str]],
    counts: Mapping[tuple[int, int], int],
    arch: ModelArchConfig,
    device: torch.device,
    mode: str,
) -> Selection:
    """``sel`` (the dense shapes' selection) joined with the quantized projections' own
    (``quant_select.quantized_selection`` at ``sel``'s dtype, its step check on ``counts``);
    ``sel`` itself when nothing is quantized or the selection is off."""
    if not quantized or sel.source == "off":
        return sel
    from kvserve.models.quant_select import quantized_selection

    head = (arch.vocab_size, arch.hidden_size)
    quant = quantized_selection(
        dict(quantized),
        counts=dict(counts),
        head_shape=head if head in quantized else None,
        act_dtype=sel.dtype,
        device=device,
        mode=mode,
    )
    measured = "measured" in (sel.source, quant.source)
    return Selection(
        sel.dtype,
        {**sel.plan, **quant.plan},
        [*sel.timings, *quant.timings],
        {**sel.skipped, **quant.skipped},
        "measured" if measured else "cache",
        sel.seconds + quant.seconds,
        max(sel.load, quant.load),
        [*sel.checks, *quant.checks],
    )


def dtype_speedup(
    arch: ModelArchConfig,
    fp32: Selection,
    bf16: Selection,
    *,
    device: torch.device,
    mode: str = "auto",
    quantized: Mapping[tuple[int, int], tuple[str, str]] | None = None,
    timer: Callable[[Linear, torch.Tensor, torch.Tensor], float] | None = None,
    attention_timer: Callable[[torch.dtype, int], float] | None = None,
    budget_s: float = 0.010,
    passes: int = 2,
) -> float:
    """fp32 time / bf16 time of a decode step's matmuls and attention (M = 1, 8, 32; each
    dtype with its chosen kernels), cached like the selections (``mode`` "measure": measured
    again).

    ``quantized`` shapes run random weights of their format and layout through the plan's
    quantized methods (the selections then hold those choices), the others dense weights.
    The attention term is one layer's paged decode attention over ``M`` sequences of
    ``DECIDING_CONTEXT`` tokens, times the layers (``attention_timer(dtype, M)``: seconds a
    call; default ``DecodeAttentionProbe``, present where the native kernels load).

    NOTE: the two dtypes are timed in alternation in one run, never taken from two selections
    measured at different times: on a shared machine those can be minutes and loads apart.
    NOTE: why attention counts, and quantized shapes as they run. On a Xeon without AMX
    (AVX512_BF16, session 14) dense bf16 matmuls ran 0.96x fp32, so the matmul-only rule
    chose fp32 for a GGUF whose int8-dot kernels run bf16 activations at least as fast (Q4_1
    sequence at M=32: 15.1 ms fp32, 10.6 bf16) and whose B=32 decode attention at 256 tokens
    took 19-20 ms a step in fp32 against 12-14 in bf16 (a bf16 cache halves the bytes read;
    docs/KERNELS_HISTORY.md, session 14).
    """
    if attention_timer is None and device.type == "cpu":
        attention_timer = DecodeAttentionProbe.if_available(arch)
    counts = projection_shapes(arch)
    formats = dict(quantized or {})
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
    cells = _decode_cells(arch, fp32, bf16, formats, device, timer or _time_linear)
    if attention_timer is not None:
        for m in _DECIDING_BOUNDS:
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
    formats: Mapping[tuple[int, int], tuple[str, str]],
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
        if shape in formats:
            from kvserve.models.quant import quantize_dense
            from kvserve.models.quant_linear import kernel_layout

            qtype, layout = formats[shape]
            source = kernel_layout(quantize_dense(w.contiguous(), qtype), layout)
        pair = []
        for sel in (fp32, bf16):
            choice = sel.plan.get(shape) if sel.source != "off" else None
            weight = w.to(sel.dtype) if isinstance(source, torch.Tensor) else source
            pair.append(build_linear(weight, act_dtype=sel.dtype, device=device, choice=choice))
        for m in _DECIDING_BOUNDS:
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
