"""Linear methods for quantized weights, registered with the linear-method layer.

Candidates for a ``QuantizedWeight`` source (``kvserve.models.quant``):

- ``QuantKernelMethod`` (``{qtype}_{isa}``, e.g. ``q4_1_avx2``; ``{qtype}_x16_{isa}`` for a
  weight in the x16 layout, e.g. ``q4_1_x16_avx512_vnni``): the native int8-dot kernels over
  the blocks as held (``native/csrc/quant/quant_linear*.cpp``); holds nothing extra.
  ``kernel_layout`` repacks a weight at load to the layout its kernel reads fastest.
- ``DequantTileMethod`` (``dequant_tile_{dtype}``): rows dequantized a tile at a time into a
  small scratch and multiplied with ``torch.mm``; holds nothing extra (large M without a copy).
- ``DequantDenseMethod`` (``dequant_{dtype}``): a dense copy made once at load, run with
  ``torch.mm``. Memory cost: ``out * in * element_size`` bytes on top of the blocks (fp32:
  4 / (bits per weight / 8) = 6.4x a Q4_1 weight; bf16 3.2x); only chosen where the selector
  measures it faster (large M, prefill).
- ``DequantPrepackedMethod`` (``dequant_onednn_{dtype}``, CPU with oneDNN, fp32 / bf16): the
  same dense copy reordered once into oneDNN's blocked layout (the dense path's
  ``onednn_prepacked_*``), which runs decode-sized M faster than ``torch.mm`` on the CPUs
  measured; same memory cost.
- ``QuantAmxInt8Method`` (``int8_amx``, bf16 on a CPU with AMX-INT8): an int8 copy per block
  of 64 inputs (1.06 bytes a weight) on AMX int8 tiles; no dequantization per call.

A fused projection whose parts have different formats (``QuantizedParts``, from
``fuse_weights``) gets ``QuantSplitMethod``: each part runs into its column slice of ``out``.

Importing this module registers ``quantized_candidates``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.models.quant import X16_QTYPES, QuantizedWeight
from kvserve.runtime import amx_int8
from kvserve.runtime.amx_linear import AmxBf16Method, amx_available, run_packed
from kvserve.runtime.autotune.candidates import onednn_supports, register_candidates
from kvserve.runtime.linear import LinearMethod, OneDnnPrepackedMethod, dtype_tag
from kvserve.runtime.native import quant_ops

WeightPart = torch.Tensor | QuantizedWeight


# NOTE: the AMX methods of a quantized weight are offered from 9 rows only (``min_rows``). Below
# that the selection's isolated timing misled on the AMX Xeon: a plan it measured with AMX bf16
# at M 2-8 for three projections (timed faster there than the VNNI kernel) ran the model's B = 8
# step 22 % slower (574 against 739 tok/s; 2026-12-04, 34e94cb; git show
# 25ace60:bench/results/session20/plans/m8.json against good.json). Worse, with AMX at M = 1
# besides (bad.json) the dtype probe, which times the plans' kernels at M = 1, 8 and 32 in
# alternation, measured bf16 at 0.99x fp32 and ``--dtype auto`` chose float32: every batch size
# and the prefill ran 20-50 % slower.
AMX_MIN_ROWS = 9


@dataclass(frozen=True)
class QuantizedParts:
    """A fused weight whose parts (stacked by rows) cannot share one block format."""

    parts: tuple[WeightPart, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(int(p.shape[0]) for p in self.parts), int(self.parts[0].shape[1]))

    @property
    def nbytes(self) -> int:
        return sum(_part_nbytes(p) for p in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense fused weight ``[out, in]``."""
        return torch.cat([_dense(p, dtype) for p in self.parts])


def _part_nbytes(part: WeightPart) -> int:
    if isinstance(part, QuantizedWeight):
        return part.nbytes
    return part.numel() * part.element_size()


def _dense(part: WeightPart, dtype: torch.dtype) -> torch.Tensor:
    return part.dequantize(dtype) if isinstance(part, QuantizedWeight) else part.to(dtype)


def fuse_weights(parts: Sequence[WeightPart]) -> torch.Tensor | QuantizedWeight | QuantizedParts:
    """Stack the rows of ``parts`` (q/k/v, gate/up) into one weight source.

    All dense: ``torch.cat``. All quantized in one format: ``QuantizedWeight.concat_rows``.
    Otherwise a ``QuantizedParts`` that ``QuantSplitMethod`` runs part by part.
    """
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(list(parts))  # type: ignore[arg-type]
    quantized = [p for p in parts if isinstance(p, QuantizedWeight)]
    if len(quantized) == len(parts) and QuantizedWeight.can_concat(quantized):
        return QuantizedWeight.concat_rows(quantized)
    return QuantizedParts(tuple(parts))


LAYOUT_ENV = "KVSERVE_QUANT_LAYOUT"
LAYOUT_CHOICES = ("auto", "plain", "x16")
# The best instruction sets under which layout "auto" takes x16 (kernel_layout).
X16_AUTO_ISAS = ("avx512_vnni", "avx2")


def kernel_layout(source: WeightPart, layout: str | None = None) -> WeightPart:
    """``source`` in the byte layout its kernel reads fastest (a dense tensor is unchanged).

    ``layout``: "auto" (default, or ``$KVSERVE_QUANT_LAYOUT``) takes ``x16`` where the native
    kernels' best instruction set has an x16 GEMV (AVX-512 VNNI, AVX2) and the weight has at
    least 16 rows (the plain layout's GEMV is compute bound there: per-row scale arithmetic),
    else ``plain``; "plain" / "x16" force one. A K-quant stays plain (it has no x16 layout).
    NOTE: a repack at load, not a copy: the caller keeps only the result.
    """
    layout = layout or os.environ.get(LAYOUT_ENV, "auto")
    if layout not in LAYOUT_CHOICES:
        raise ValueError(f"{LAYOUT_ENV}={layout!r}: choose one of {', '.join(LAYOUT_CHOICES)}")
    if isinstance(source, QuantizedParts):
        return QuantizedParts(tuple(kernel_layout(p, layout) for p in source.parts))  # type: ignore[misc]
    if not isinstance(source, QuantizedWeight):
        return source
    if source.qtype not in X16_QTYPES:
        return source.plain()
    if layout == "auto":
        # NOTE: measured, projection sequence of the embedded model (bench/probes/quant_seq.py at
        # 25ace60): AVX2 on Zen 3, two runs each: x16 8.4-9.4 / 15.6-19.1 / 48.9-58.9 ms, plain
        # 16.6-22.4 / 31.8-38.0 / 134.5-135.3 ms at M = 1 / 8 / 32 (2026-12-02, efdd138); AVX-512
        # VNNI on the Zen 4 EPYC: docs/kernels-rationale.md, section 4.
        # AVX-VNNI has no x16 kernel.
        fast = quant_ops.available() and quant_ops.best_isa() in X16_AUTO_ISAS
        layout = "x16" if fast and source.out_features >= 16 else "plain"
    return source.interleaved() if layout == "x16" else source.plain()


def is_quantized(source: object) -> bool:
    """Whether ``source`` is a quantized weight source (held in blocks, at least partly)."""
    return isinstance(source, QuantizedWeight | QuantizedParts)


def embedding_lookup(
    weight: QuantizedWeight,
    ids: torch.Tensor,  # int64 [T]
    out: torch.Tensor,  # [T, hidden]
) -> torch.Tensor:
    """Rows ``ids`` of a quantized embedding table, dequantized into ``out``.

    NOTE: only the T gathered rows are dequantized; the table stays in blocks.
    """
    if quant_ops.available() and out.device.type == "cpu":
        return quant_ops.embedding(ids, weight.data, weight.qtype, out, layout=weight.layout)
    table = weight.plain()
    rows = QuantizedWeight(table.qtype, table.data[ids.cpu()], (ids.shape[0], table.shape[1]))
    return out.copy_(rows.dequantize(torch.float32))


class QuantKernelMethod(LinearMethod):
    """The native int8-dot kernel over a ``QuantizedWeight``'s blocks (see module docstring).

    ``isa`` forces an instruction set ("avx512_vnni", "avx_vnni", "avx2", "scalar"); "auto"
    takes the best the CPU has, and the name says which. A weight in the ``x16`` layout runs
    on "avx512_vnni", "avx2" or "scalar" only (ValueError for "avx_vnni").
    """

    shares_source = True
    supports_bias = False

    def __init__(self, weight: QuantizedWeight, *, isa: str = "auto") -> None:
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.isa = quant_ops.best_isa() if isa == "auto" else isa
        if weight.layout == "x16" and self.isa not in quant_ops.X16_ISAS:
            raise ValueError(
                f"a weight in the x16 layout runs on {' or '.join(quant_ops.X16_ISAS)}, not on "
                f"{self.isa}; keep it plain (kernel_layout(w, 'plain')) for that instruction set"
            )
        suffix = "_x16" if weight.layout == "x16" else ""
        self.name = f"{weight.qtype}{suffix}_{self.isa}"

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def streamed_tensors(self) -> list[torch.Tensor]:
        return [self.weight.data]

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        w = self.weight
        return quant_ops.linear(x, w.data, w.qtype, out=out, isa=self.isa, layout=w.layout)


class QuantAmxBf16Method(LinearMethod):
    """bf16 activations times an x16 weight on AMX bf16 tiles, dequantized inside the GEMM
    (``kvserve_quant::amx_bf16_linear``): the dense AMX copy's result bit for bit, with no
    copy held.

    NOTE: why: from ~16 rows the int8-dot kernels are compute bound, and before this the
    selection took a dense bf16 copy there (3.6x the Q4_1 bytes, held beside the blocks). On
    the AMX Xeon the embedded model's projection sequence ran within 2-6 % of the copy at M
    1-512 (2026-12-02, 7f85a6c).
    """

    shares_source = True
    supports_bias = False
    min_rows = AMX_MIN_ROWS

    def __init__(self, weight: QuantizedWeight) -> None:
        if weight.layout != "x16":
            raise ValueError("amx_bf16 dequantizes weights in the x16 layout only")
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.name = f"{weight.qtype}_x16_amx_bf16"

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        return quant_ops.amx_bf16_linear(x, self.weight.data, self.weight.qtype, out=out)


class DenseCopyMethod(LinearMethod):
    """A dense ``act_dtype`` copy of a quantized weight, made by ``prepare``: the base of the
    two layouts below (``out * in * itemsize`` bytes either way).

    NOTE: the copy is made by ``prepare`` (when a ``Linear`` takes the method) or the first
    ``apply`` (the selector's first timing run), so that listing the candidates of a model
    costs no dense copy of every weight; ``nbytes`` is the copy's size either way.
    """

    shares_source = False
    supports_bias = True

    def __init__(
        self, source: QuantizedWeight | QuantizedParts, act_dtype: torch.dtype, name: str
    ) -> None:
        self.source = source
        self.act_dtype = act_dtype
        self.out_features, self.in_features = source.shape
        self.name = name

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.act_dtype.itemsize


class DequantDenseMethod(DenseCopyMethod):
    """The dense copy as a contiguous ``[in, out]`` tensor, run with ``torch.mm``."""

    def __init__(self, source: QuantizedWeight | QuantizedParts, act_dtype: torch.dtype) -> None:
        super().__init__(source, act_dtype, f"dequant_{dtype_tag(act_dtype)}")
        self.weight_t: torch.Tensor | None = None  # [in, out], made by prepare

    def prepare(self) -> None:
        if self.weight_t is None:
            # [in, out] contiguous: the layout MKL ran fastest for decode (models/decoder_layer.py).
            self.weight_t = self.source.dequantize(self.act_dtype).t().contiguous()

    def streamed_tensors(self) -> list[torch.Tensor]:
        return [] if self.weight_t is None else [self.weight_t]

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.weight_t is None:
            self.prepare()
        if self.bias is None:
            return torch.mm(x, self.weight_t, out=out)
        return torch.addmm(self.bias, x, self.weight_t, out=out)


class DequantPrepackedMethod(DenseCopyMethod):
    """The dense copy in oneDNN's blocked layout (``OneDnnPrepackedMethod`` over the
    dequantized weight).

    NOTE: why a second layout: where the selector prefers a copy (M above the int8 kernel's
    range), the dense model's own selection runs oneDNN prepacked at decode sizes, and with
    only the ``torch.mm`` copy a quantized model ran those steps slower than the dense model
    (694.5 vs 786.6 tok/s at B=32 on the AMX Xeon, 2026-12-01, d0207ff; in 25ace60:
    bench/results/session7/runtime_speed_defaultquantization_auto.txt and
    runtime_speed_default.txt).
    """

    allocates = True
    shape_cached = True
    dense_name = "onednn"

    def __init__(self, source: QuantizedWeight | QuantizedParts, act_dtype: torch.dtype) -> None:
        super().__init__(source, act_dtype, f"dequant_{self.dense_name}_{dtype_tag(act_dtype)}")
        self.packed: LinearMethod | None = None  # made by prepare

    def dense_method(self, weight: torch.Tensor) -> LinearMethod:
        """The dense method run on the dequantized ``weight`` [out, in]."""
        return OneDnnPrepackedMethod(weight)

    def prepare(self) -> None:
        if self.packed is None:
            self.packed = self.dense_method(self.source.dequantize(self.act_dtype))
            self.packed.prepare()

    def streamed_tensors(self) -> list[torch.Tensor]:
        return [] if self.packed is None else self.packed.streamed_tensors()

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is None:
            self.prepare()
        assert self.packed is not None
        # NOTE: ``Linear`` sets ``bias`` on this method after building it.
        self.packed.bias = self.bias
        return self.packed.apply(x, out)


class DequantAmxMethod(DequantPrepackedMethod):
    """The dense bf16 copy in AMX tiles (``AmxBf16Method`` over the dequantized weight): the
    layout the dense model's own selection takes on an AMX CPU (the AMX Xeon,
    2026-12-02, 7797456: every bucket)."""

    allocates = False
    shape_cached = False
    supports_bias = False
    min_rows = AMX_MIN_ROWS
    dense_name = "amx"

    def dense_method(self, weight: torch.Tensor) -> LinearMethod:
        return AmxBf16Method(weight)


class QuantAmxInt8Method(DenseCopyMethod):
    """An int8 copy per block of 64 inputs on AMX int8 tiles (``kvserve::amx_int8_linear``,
    ``kvserve/runtime/amx_int8.py``), activations quantized the same way per call.

    NOTE: why: at decode sizes the AMX bf16 kernel on the blocks is bound by dequantizing
    them, per call; this copy goes into the tiles as held, at 1.06 bytes a weight (1.7x
    Q4_1). Offered for quantized weights only: a dense model keeps the precision it was
    given; a GGUF's weights are rounded already, and this rounding, simulated at every row
    count, left the embedded model's perplexity within noise of fp32 (bench/ACCURACY.md).
    """

    supports_bias = False
    min_rows = AMX_MIN_ROWS

    def __init__(self, source: QuantizedWeight | QuantizedParts) -> None:
        super().__init__(source, torch.bfloat16, "int8_amx")
        self.packed: torch.Tensor | None = None  # int8 [ceil(out/32), ceil(in/64) * 2176]

    @property
    def nbytes(self) -> int:
        rows, row_bytes = amx_int8.packed_shape(self.out_features, self.in_features)
        return rows * row_bytes

    def prepare(self) -> None:
        if self.packed is None:
            self.packed = amx_int8.pack_int8_weight(self.source.dequantize(torch.float32))

    def streamed_tensors(self) -> list[torch.Tensor]:
        return [] if self.packed is None else [self.packed]

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self.prepare()
        assert self.packed is not None
        op = torch.ops.kvserve.amx_int8_linear
        return run_packed(op, self.packed, x, out, self.out_features)


class DequantTileMethod(LinearMethod):
    """Dequantize a tile of rows at a time into a small scratch, then ``torch.mm`` it.

    For large M (prefill) a dense GEMM beats the int8-dot kernel; this gets most of that
    without holding a dense copy: the scratch is ``tile_rows x in`` values (~128 KiB, cache
    resident), reused per call. NOTE: the dequantization costs ``out x in`` values per call,
    which only pays off when M is large (the selector measures where).
    """

    shares_source = True
    supports_bias = False

    def __init__(self, weight: QuantizedWeight, act_dtype: torch.dtype) -> None:
        self.weight = weight
        self.act_dtype = act_dtype
        self.out_features, self.in_features = weight.shape
        self.tile_rows = max(16, (1 << 16) // self.in_features // 16 * 16)
        self.name = f"dequant_tile_{dtype_tag(act_dtype)}"
        self._ids = torch.arange(self.out_features, dtype=torch.long)
        self._scratch: torch.Tensor | None = None  # [tile_rows, in], made on first use

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        if self._scratch is None or self._scratch.dtype != x.dtype:
            self._scratch = torch.empty(self.tile_rows, self.in_features, dtype=x.dtype)
        w = self.weight
        for r0 in range(0, self.out_features, self.tile_rows):
            r1 = min(r0 + self.tile_rows, self.out_features)
            tile = self._scratch[: r1 - r0]  # [rows, in]
            quant_ops.embedding(self._ids[r0:r1], w.data, w.qtype, tile, layout=w.layout)
            out[:, r0:r1].copy_(torch.mm(x, tile.t()))
        return out


class QuantSplitMethod(LinearMethod):
    """A fused weight of mixed formats: each part writes its column slice of ``out``."""

    shares_source = True
    supports_bias = False

    def __init__(
        self, source: QuantizedParts, act_dtype: torch.dtype, *, isa: str = "auto"
    ) -> None:
        self.source = source
        self.out_features, self.in_features = source.shape
        # (first column, end column, kernel or a dense part's [in, out] weight)
        self.runs: list[tuple[int, int, QuantKernelMethod | torch.Tensor]] = []
        start = 0
        for part in source.parts:
            end = start + int(part.shape[0])
            if isinstance(part, QuantizedWeight):
                run: QuantKernelMethod | torch.Tensor = QuantKernelMethod(part, isa=isa)
            else:
                run = part.to(act_dtype).t()
            self.runs.append((start, end, run))
            start = end
        isa_name = quant_ops.best_isa() if isa == "auto" else isa
        self.name = f"split_{isa_name}"

    @property
    def nbytes(self) -> int:
        return self.source.nbytes

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        for start, end, run in self.runs:
            if isinstance(run, QuantKernelMethod):
                run.apply(x, out[:, start:end])
            else:
                out[:, start:end].copy_(torch.mm(x, run))
        return out


@register_candidates
def quantized_candidates(
    source: object, *, act_dtype: torch.dtype, device: torch.device
) -> list[LinearMethod]:
    """The kernel (when the native quantized kernels load, on CPU), the tiled dequantization,
    and the copies: dense (``torch.mm``; on CPU oneDNN prepacked and, for bf16 on an AMX CPU,
    AMX tiles) and, for bf16 on a CPU with AMX-INT8, int8 on AMX tiles."""
    if not is_quantized(source):
        return []
    methods: list[LinearMethod] = []
    if device.type == "cpu" and quant_ops.available():
        if isinstance(source, QuantizedWeight):
            methods.append(QuantKernelMethod(source))
            if (
                source.layout == "x16"
                and act_dtype == torch.bfloat16
                and quant_ops.amx_bf16_available()
            ):
                methods.append(QuantAmxBf16Method(source))
            methods.append(DequantTileMethod(source, act_dtype))
        else:
            methods.append(QuantSplitMethod(source, act_dtype))  # type: ignore[arg-type]
    methods.append(DequantDenseMethod(source, act_dtype))  # type: ignore[arg-type]
    if device.type == "cpu" and onednn_supports(act_dtype):
        methods.append(DequantPrepackedMethod(source, act_dtype))  # type: ignore[arg-type]
    if device.type == "cpu" and act_dtype == torch.bfloat16 and amx_available():
        methods.append(DequantAmxMethod(source, act_dtype))  # type: ignore[arg-type]
    if device.type == "cpu" and act_dtype == torch.bfloat16 and amx_int8.amx_int8_available():
        methods.append(QuantAmxInt8Method(source))  # type: ignore[arg-type]
    return methods
