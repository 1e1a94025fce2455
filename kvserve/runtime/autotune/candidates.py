"""What the selection chooses from: the kernels (``LinearMethod`` factories), the M buckets, the
projection shapes, the dtypes and the quantized projections, on this CPU.

Kernels offer themselves through ``register_candidates``: a factory takes a weight source (a
dense ``torch.Tensor`` [out, in], or a quantized weight, issue #16) and returns the methods it
can build for it (an empty list when none applies); a factory that raises is skipped with its
reason logged. The dense ones (``torch.mm``, oneDNN prepacked) are registered here, the AMX
ones by ``runtime/amx_linear.py``, the quantized ones by ``models/quant_linear.py``.
``build_linear`` turns a chosen plan's names back into the methods of a ``Linear``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.config import ModelArchConfig
from kvserve.runtime.linear import (
    M_MAX,
    DenseMmMethod,
    Linear,
    LinearMethod,
    OneDnnPrepackedMethod,
    dtype_tag,
)

log = logging.getLogger(__name__)

Shape = tuple[int, int]

SELECTION_MODES = ("auto", "measure", "off")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)

# NOTE: 9-16 apart from 17-32: probed at 32 rows only, the 9-32 bucket took AMX bf16 for
# every projection on the AMX Xeon, slower than the VNNI kernel at 12-16 rows on the gate/up
# and qkv; with the bucket, bare decode at B = 12 / 16 ran 3-14 % / 3-10 % faster
# (2026-12-04, 545a8d6; git show 25ace60:bench/results/session20/bucket16_ab.txt; B = 8, 24,
# 32 level).
DECODE_BOUNDS = (1, 8, 16, 32, 128)
PREFILL_BOUNDS = (256,)  # prefill chunks up to 256 rows, probed at 256 (then PREFILL_PROBE)
PREFILL_PROBE = 512


def check_mode(mode: str) -> str:
    """``mode`` if it is a selection mode; else ValueError listing the choices."""
    if mode not in SELECTION_MODES:
        raise ValueError(
            f"unknown kernel selection mode {mode!r}; choose one of {', '.join(SELECTION_MODES)}"
        )
    return mode


def m_buckets() -> list[tuple[int, int]]:
    """``(max_m, probe_m)`` per bucket: the decode sizes, then two for prefill chunks.

    Each bucket is measured at its largest M (``probe_m``); the last one takes every M above
    256 and is probed at ``PREFILL_PROBE`` rows (the default ``max_num_batched_tokens``).
    NOTE: a chunk beside running decodes is often 129-256 rows, where the ranking can differ
    from 512 rows' (AMX Xeon, cold weights: oneDNN ahead at 132 rows, ``torch.mm`` at 512).
    NOTE: fixed, not derived from the engine's options: engines with other token budgets
    share one cached selection (and so run the same kernels for the same M).
    """
    bounds = (*DECODE_BOUNDS, *PREFILL_BOUNDS)
    return [*((b, b) for b in bounds), (M_MAX, PREFILL_PROBE)]


def projection_shapes(arch: ModelArchConfig) -> dict[Shape, int]:
    """(out, in) of every projection weight -> how many a decode step runs (layers; lm_head 1)."""
    h, d = arch.hidden_size, arch.head_dim
    q = arch.num_attention_heads * d
    kv = arch.num_key_value_heads * d
    counts: dict[Shape, int] = {}
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


# ---- this CPU ------------------------------------------------------------------------------


def _cpuinfo_field(name: str) -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> str:
    """The CPU's feature flags, space-separated (from /proc/cpuinfo; "" where unknown)."""
    return _cpuinfo_field("flags")


def cpu_identity() -> tuple[str, str]:
    """The CPU's model name and a hash of its feature flags (from /proc/cpuinfo)."""
    import platform

    model = _cpuinfo_field("model name") or platform.processor() or platform.machine()
    return model, hashlib.sha256(cpu_flags().encode()).hexdigest()[:16]


def native_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (AMX-BF16 or AVX512_BF16)."""
    flags = set(cpu_flags().split())
    return bool(flags & {"amx_bf16", "avx512_bf16"})


def onednn_available() -> bool:
    """Whether torch's oneDNN linear ops can be used on CPU."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def onednn_supports(act_dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack and run a linear in ``act_dtype`` on this CPU.

    NOTE: oneDNN's bf16 linear needs AVX512BW/VL/DQ or AVX-NE-CONVERT; on an AVX2-only CPU
    ``_reorder_linear_weight`` raises for bf16, so the candidate is left out up front instead
    of failing at build time (and taking the other dense methods down with it).
    """
    if act_dtype not in (torch.float32, torch.bfloat16) or not onednn_available():
        return False
    return act_dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# ---- the kernels ---------------------------------------------------------------------------

CandidateFactory = Callable[..., list[LinearMethod]]
_FACTORIES: list[CandidateFactory] = []


def register_candidates(factory: CandidateFactory) -> CandidateFactory:
    """Add ``factory(weight_source, *, act_dtype, device) -> list[LinearMethod]``.

    Registering the same factory twice is a no-op. Returns ``factory`` (usable as a decorator).
    """
    if factory not in _FACTORIES:
        _FACTORIES.append(factory)
    return factory


def registered_factories() -> tuple[CandidateFactory, ...]:
    """The registered candidate factories, in registration order."""
    return tuple(_FACTORIES)


@register_candidates
def dense_candidates(
    source: Any, *, act_dtype: torch.dtype, device: torch.device
) -> list[LinearMethod]:
    """The dense methods: ``torch.mm`` (MKL) and, on CPU, oneDNN prepacked (fp32 / bf16)."""
    if not isinstance(source, torch.Tensor) or source.dim() != 2:
        return []
    weight = source if source.dtype == act_dtype else source.to(act_dtype)
    methods: list[LinearMethod] = [DenseMmMethod(weight)]
    if device.type == "cpu" and act_dtype in (torch.float32, torch.bfloat16):
        if onednn_supports(act_dtype):
            methods.append(OneDnnPrepackedMethod(weight))
        else:
            log.debug(
                "linear candidate onednn_prepacked_%s skipped: oneDNN %s linear unavailable",
                dtype_tag(act_dtype),
                act_dtype,
            )
    return methods


def candidate_methods(
    source: Any,
    *,
    act_dtype: torch.dtype,
    device: torch.device,
    skipped: dict[str, str] | None = None,
    factories: Sequence[CandidateFactory] | None = None,
) -> list[LinearMethod]:
    """Every method the registered factories (or ``factories``) can build for ``source``
    (names unique; the first factory offering a name wins).

    A factory that raises is skipped: its reason is logged and recorded in ``skipped``
    (factory name -> reason) when given.
    """
    methods: list[LinearMethod] = []
    seen: set[str] = set()
    for factory in _FACTORIES if factories is None else factories:
        try:
            built = factory(source, act_dtype=act_dtype, device=device)
        except Exception as e:  # noqa: BLE001 - any failure means "not this candidate"
            name = getattr(factory, "__name__", repr(factory))
            reason = f"{type(e).__name__}: {e}"
            log.warning("linear candidate factory %s skipped: %s", name, reason)
            if skipped is not None:
                skipped[name] = reason
            continue
        for m in built:
            if m.name not in seen:
                seen.add(m.name)
                methods.append(m)
    return methods


def build_linear(
    source: Any,
    bias: torch.Tensor | None = None,
    *,
    act_dtype: torch.dtype,
    device: torch.device,
    choice: Sequence[tuple[int, str]] | None = None,
    factories: Sequence[CandidateFactory] | None = None,
) -> Linear:
    """A ``Linear`` for ``source``: ``choice`` names the method per bucket (``(max_m, name)``).

    ``choice`` None: ``torch.mm`` on the weight (the original path) for every M. A chosen
    name no candidate offers falls back to that path with a warning.
    """
    if choice is None:
        if not isinstance(source, torch.Tensor):
            # NOTE: e.g. a quantized weight: its factory lists its own kernel first.
            return Linear(source, [(M_MAX, _first_candidate(source, act_dtype, device))], bias)
        return Linear(source, [(M_MAX, DenseMmMethod(source))], bias)
    wanted = {name for _, name in choice}
    by_name = {
        m.name: m
        for m in candidate_methods(source, act_dtype=act_dtype, device=device, factories=factories)
        if m.name in wanted
    }
    buckets: list[tuple[int, LinearMethod]] = []
    fallback: LinearMethod | None = None
    for max_m, name in choice:
        method = by_name.get(name)
        if method is None:
            log.warning("linear method %s unavailable for %s: using torch.mm", name, _shape(source))
            if fallback is None:
                fallback = (
                    DenseMmMethod(source)
                    if isinstance(source, torch.Tensor)
                    else _first_candidate(source, act_dtype, device)
                )
            method = fallback
        buckets.append((max_m, method))
    return Linear(source, buckets, bias)


def _first_candidate(source: Any, act_dtype: torch.dtype, device: torch.device) -> LinearMethod:
    """The first method the registered factories offer for a non-tensor ``source``."""
    methods = candidate_methods(source, act_dtype=act_dtype, device=device)
    if not methods:
        raise ValueError(f"no linear method can run a {type(source).__name__} weight source")
    return methods[0]


def _shape(source: Any) -> tuple[int, ...]:
    shape = getattr(source, "shape", ())
    return tuple(int(s) for s in shape)


# ---- the quantized projections -------------------------------------------------------------


@dataclass(frozen=True)
class QuantizedProjections:
    """A model's quantized projections, as the selection needs them; the model side builds
    it (``kvserve.models.quant_select.quantized_projections``), so autotune needs nothing of
    the quantized formats but what is here.

    ``formats``: (out, in) -> (block format, layout). ``counts``: the calls a decode step
    makes of each shape, in step order (the layers', then the lm_head's). ``make_source``:
    a dense float32 ``[out, in]`` weight -> a weight source of that format and layout, as the
    model holds it. ``factory``: the candidate factory of the quantized kernels.
    """

    formats: Mapping[Shape, tuple[str, str]]
    counts: Mapping[Shape, int]
    make_source: Callable[[torch.Tensor, str, str], object]
    factory: CandidateFactory
