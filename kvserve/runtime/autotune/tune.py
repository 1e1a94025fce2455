"""The entry point: the model dtype (``--dtype auto``) and the projection kernels, chosen once
per start-up (``choose_kernels``).

The dtype: on CUDA ``auto`` is bfloat16 (float16 without bf16 support); on CPU it is bfloat16
only where the CPU has native bf16 arithmetic (AMX or AVX512_BF16) *and* a decode step's
matmuls and attention (each dtype with its chosen kernels, timed in alternation:
``measure_dtype.dtype_speedup``) run faster in bf16; else float32. An explicit ``bfloat16``
on a CPU without native bf16 runs, with a warning giving the measured slowdown.

The kernels, for that dtype: the fastest ``LinearMethod`` per projection shape and M bucket,
``select.select_kernels`` for the dense shapes and ``select.quantized_selection`` for the
quantized ones. A model whose weights load quantized is chosen for after the load (the
pending choice), when its quantized shapes are known.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass

import torch

from kvserve.config import ModelArchConfig
from kvserve.runtime.autotune.candidates import (
    DECODE_BOUNDS,
    DTYPE_CHOICES,
    DTYPES,
    QuantizedProjections,
    check_mode,
    native_bf16,
    projection_shapes,
)
from kvserve.runtime.autotune.choose import Selection, plan_of
from kvserve.runtime.autotune.measure_dtype import DECIDING_BOUNDS, dtype_speedup
from kvserve.runtime.autotune.select import quantized_selection, select_kernels
from kvserve.runtime.linear import LinearPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TuneSettings:
    """What the choice depends on of the engine's options (start-up builds it from its
    ``EngineConfig``): ``dtype`` ("auto" or a name in ``DTYPES``), ``device`` and ``mode``
    (``--kernel-selection``: "auto", "measure" or "off"); ``batch_invariant``
    (``--batch-invariant``): one row-invariant method per projection for every M
    (``invariant.choose_invariant``), so a token's result does not depend on its batch."""

    dtype: str = "auto"
    device: str = "cpu"
    mode: str = "auto"
    batch_invariant: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(
                f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}"
            )
        check_mode(self.mode)


@dataclass(frozen=True)
class KernelChoice:
    """The dtype chosen and the kernel selection for it (plus a line saying why)."""

    dtype: torch.dtype
    selection: Selection
    reason: str
    # The dtype asked for ("auto" or a name) while the choice waits for the model's quantized
    # projections (the pending choice); ``dtype`` is then the one to load the weights in.
    pending: str | None = None

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def plan(self) -> LinearPlan | None:
        """The ``LinearPlan`` to hand the model (None: the original path, ``torch.mm``)."""
        return plan_of(self.selection)

    def short(self) -> str:
        """The dtype (and why) and where the kernel choice came from, in a few words."""
        how = {"off": "selection off", "cache": "from cache"}.get(self.selection.source, "measured")
        return f"dtype {self.dtype_name} ({self.reason}); kernels {how}"

    def summary(self) -> str:
        """One line for the start-up summary: dtype (and why), then the kernels."""
        return f"dtype {self.dtype_name} ({self.reason}); {self.selection.summary()}"


def choose_kernels(
    settings: TuneSettings,
    arch: ModelArchConfig | None = None,
    quantized: QuantizedProjections | None = None,
) -> KernelChoice:
    """Resolve ``settings.dtype`` (see the module docstring) and select the kernels for it.

    ``arch`` None: the model's weights load quantized and are not read yet, so which shapes
    run quantized is unknown: the pending choice, nothing measured (the weights load in the
    requested dtype, float32 for ``auto``, cast once decided); start-up calls again after the
    load with ``quantized``.

    ``quantized``: the model's quantized projections. They run their own kernel selection per
    dtype, which ``auto`` times as they run, and the dense selection covers only the other
    shapes; the choice's selection holds both, so it is the model's whole plan.

    NOTE: the pending choice, because the dense selection times only the shapes that stay
    dense. Measured before the load, it timed every projection shape densely in both dtypes
    (and checked each plan on passes holding up to 768 MB of copies), for a model whose
    projections all run quantized: 12 s of a 41 s first start-up of the embedded model on the
    AMX Xeon (2026-12-06, 23deba4; git show 25ace60:bench/results/session31/cold_start.txt).
    """
    if arch is None:
        return _pending(settings)
    device = torch.device(settings.device)
    mode = settings.mode
    invariant = settings.batch_invariant

    def select(dtype: torch.dtype, how: str) -> Selection:
        formats = quantized.formats if quantized else ()
        dense = select_shapes(device, arch, dtype, how, formats, batch_invariant=invariant)
        return _with_quantized(dense, quantized, arch, device, how, batch_invariant=invariant)

    if settings.dtype != "auto":
        dtype = DTYPES[settings.dtype]
        if device.type == "cpu" and dtype == torch.bfloat16 and not native_bf16():
            probe = "auto" if mode == "off" else mode
            fp32, bf16 = select(torch.float32, probe), select(dtype, probe)
            speedup = dtype_speedup(arch, fp32, bf16, device=device, mode=mode, quantized=quantized)
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
    ratio = dtype_speedup(arch, fp32, bf16, device=device, mode=probe, quantized=quantized)
    dtype, sel = (torch.bfloat16, bf16) if ratio > 1.0 else (torch.float32, fp32)
    if mode == "off":
        sel = select(dtype, "off")
    what = "quantized matmuls" if quantized and quantized.formats else "matmuls"
    reason = f"auto: native bf16, decode {what} + attention bf16 {ratio:.2f}x fp32 speed"
    log.debug("kernel choice: %s", reason)
    return KernelChoice(dtype, sel, reason)


def _pending(settings: TuneSettings) -> KernelChoice:
    """The choice for a model whose quantized projections are not read yet: nothing measured,
    the weights to load in the requested dtype (float32 for ``auto``, cast once decided)."""
    dtype = torch.float32 if settings.dtype == "auto" else DTYPES[settings.dtype]
    selection = Selection(dtype, {}, source="off" if settings.mode == "off" else "cache")
    return KernelChoice(dtype, selection, "pending", pending=settings.dtype)


def select_shapes(
    device: torch.device | str,
    arch: ModelArchConfig,
    dtype: torch.dtype,
    mode: str,
    quantized: Collection[tuple[int, int]] = (),
    *,
    batch_invariant: bool = False,
) -> Selection:
    """The dense selection for the projection shapes outside ``quantized`` (those run their
    own kernels, ``_with_quantized``): an empty plan when every shape is quantized;
    ``batch_invariant``: as ``select.select_kernels``."""
    counts = {s: n for s, n in projection_shapes(arch).items() if s not in quantized}
    if not counts:
        return Selection(dtype, {}, source="off" if mode == "off" else "cache")
    return select_kernels(
        counts,
        act_dtype=dtype,
        device=device,
        mode=mode,
        counts=counts,
        # NOTE: the lm_head runs on the sampled rows only: measured up to the decode sizes.
        max_rows={(arch.vocab_size, arch.hidden_size): DECODE_BOUNDS[-1]},
        batch_invariant=batch_invariant,
    )


def decode_matmul_seconds(sel: Selection, arch: ModelArchConfig) -> float:
    """Measured matmul seconds of decode steps at M = 1, 8 and 32 (summed), chosen kernels."""
    return sel.total_seconds(DECIDING_BOUNDS, projection_shapes(arch))


def _with_quantized(
    sel: Selection,
    quantized: QuantizedProjections | None,
    arch: ModelArchConfig,
    device: torch.device,
    mode: str,
    *,
    batch_invariant: bool = False,
) -> Selection:
    """``sel`` (the dense shapes' selection) joined with the quantized projections' own
    (``quantized_selection`` at ``sel``'s dtype, its step check on ``quantized.counts``);
    ``sel`` itself when nothing is quantized or the selection is off."""
    if quantized is None or not quantized.formats or sel.source == "off":
        return sel
    head = (arch.vocab_size, arch.hidden_size)
    quant = quantized_selection(
        quantized,
        head_shape=head if head in quantized.formats else None,
        act_dtype=sel.dtype,
        device=device,
        mode=mode,
        batch_invariant=batch_invariant,
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
