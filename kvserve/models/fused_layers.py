"""Every decoder layer of a step in one native call, where the step allows it.

``kvserve::decode_layers`` (``kvserve/runtime/native/csrc/decode_layers.cpp``) runs what
``LlamaDecoderLayer.forward`` runs for each layer (add + RMSNorm, the qkv projection, RoPE,
the K/V write, paged decode attention, the o projection, add + RMSNorm, gate/up, SiLU x up,
down), with the same kernels on the same buffers in the same order, so the results are the
same bit for bit. It takes a step when:

- the layers run the native layer ops and are plain ``LlamaDecoderLayer`` s (not the
  tensor-parallel ones, which all-reduce between them) without q/k norms (Qwen3's run
  between the projection and RoPE, which the native call does not) or routed experts,
  without Gemma's norms of the attention and MLP outputs or its GeGLU, all reading the
  step's metadata as it is (one window, no soft cap: ``LlamaForCausalLM.run_layers`` checks);
- every projection of every layer runs one of these methods at this step's row count, with
  no bias: the int8-dot kernel (``QuantKernelMethod``), AMX bf16 on the blocks
  (``QuantAmxBf16Method``), AMX int8 on an int8 copy (``QuantAmxInt8Method``), a split of
  int8-dot parts (``QuantSplitMethod``, mixed formats in one fused weight), AMX bf16 on a
  dense weight in tiles (``AmxBf16Method``), ``torch.mm`` (``DenseMmMethod``) or oneDNN on a
  prepacked weight (``OneDnnPrepackedMethod``), the last two unless ``Linear`` would pad the
  rows; the dense copies of quantized weights (``DequantDenseMethod``,
  ``DequantPrepackedMethod``, ``DequantAmxMethod``) run as the dense method they hold. That
  is a GGUF model as stored and a dense model in fp32 or bf16, on every CPU kind;
- the attention backend is ``NativeCPUBackend`` and every query row of the step goes through
  its decode kernel (decodes, and chunks up to its measured limit) on an unquantized CPU
  cache.

Any other step runs the layers one by one. ``KVSERVE_FUSED_LAYERS=0`` in the environment
turns the fused call off (for A/B measurements).

NOTE: why. At B=1 the embedded model's step dispatched 343 ops from Python: ~2 us of
dispatch each plus the wrappers around them; its kernels alone took 3.6 ms of a 5.3 ms step
(the Xeon without AMX, 2026-12-03, 33ddfab; docs/kernels-rationale.md, section 7).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch._subclasses.fake_tensor import FakeTensor

from kvserve.models.decoder_layer import LlamaDecoderLayer, StepViews
from kvserve.models.quant_linear import (
    DenseCopyMethod,
    DequantDenseMethod,
    DequantPrepackedMethod,
    QuantAmxBf16Method,
    QuantAmxInt8Method,
    QuantKernelMethod,
    QuantSplitMethod,
)
from kvserve.runtime.amx_linear import AmxBf16Method
from kvserve.runtime.attention.interface import AttentionBackend
from kvserve.runtime.attention.metadata import AttentionMetadata
from kvserve.runtime.attention.native_cpu import NativeCPUBackend
from kvserve.runtime.layer_ops import NATIVE_OPS, LayerOps
from kvserve.runtime.linear import DenseMmMethod, LinearMethod, OneDnnPrepackedMethod, row_bucket
from kvserve.runtime.native.quant_ops import ISA_CODES, LAYOUT_CODES, QTYPE_CODES

DISABLE_ENV = "KVSERVE_FUSED_LAYERS"  # "0" runs the layers one by one
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def enabled_by_env() -> bool:
    """Whether the environment leaves the fused call on (``KVSERVE_FUSED_LAYERS`` != "0")."""
    return os.environ.get(DISABLE_ENV, "1") != "0"


# A projection part's codes (native/csrc/decode_layers.cpp): kind, qtype, isa,
# layout, first and end output column.
PART_INT8_DOT = 0  # kvserve_quant::linear
PART_AMX_BF16 = 1  # kvserve_quant::amx_bf16_linear
PART_MM = 2  # torch.mm on the [in, out] weight (DenseMmMethod)
PART_ONEDNN = 3  # mkldnn::_linear_pointwise on the prepacked weight (OneDnnPrepackedMethod)
PART_AMX_INT8 = 4  # kvserve::amx_int8_linear on the int8 copy (QuantAmxInt8Method)
PART_AMX_DENSE = 5  # kvserve::amx_linear on a dense weight in tiles (AmxBf16Method)


@dataclass(frozen=True, slots=True)
class FusedLayers:
    """The per-layer arguments of ``decode_layers`` for one build of the projections."""

    input_norms: list[torch.Tensor]  # per layer [h]
    post_norms: list[torch.Tensor]  # per layer [h]
    weights: list[torch.Tensor]  # every projection's parts in order (blocks or dense)
    parts: list[int]  # 6 codes per weight (PART_* kind, qtype, isa, layout, columns)
    part_counts: list[int]  # parts of each projection: 4 per layer (qkv, o, gate_up, down)


def projection_parts(
    method: LinearMethod, num_rows: int
) -> list[tuple[torch.Tensor, list[int]]] | None:
    """``method``'s kernel calls at ``num_rows`` rows as (weight, codes) parts, or None for a
    method the fused call does not run (a split with a dense part, a shape-cached one that
    ``Linear`` would run on padded rows). A dense copy of a quantized weight runs as the
    dense method it holds."""
    if method.shape_cached and row_bucket(num_rows) != num_rows:
        return None
    if isinstance(method, DenseCopyMethod):  # the copy (or the int8 one) made once
        method.prepare()
        if isinstance(method, DequantPrepackedMethod):  # oneDNN or AMX tiles
            assert method.packed is not None
            method = method.packed
    kind = type(method)
    if kind is DenseMmMethod or kind is DequantDenseMethod:
        return [(method.weight_t, [PART_MM, 0, 0, 0, 0, method.out_features])]
    if kind is OneDnnPrepackedMethod:
        return [(method.packed, [PART_ONEDNN, 0, 0, 0, 0, method.out_features])]
    if kind is AmxBf16Method:
        method.prepare()
        assert method.packed is not None
        return [(method.packed, [PART_AMX_DENSE, 0, 0, 0, 0, method.out_features])]
    if kind is QuantKernelMethod:
        return [(method.weight.data, [*_int8_dot_codes(method), 0, method.out_features])]
    if kind is QuantAmxBf16Method:
        w = method.weight
        codes = [QTYPE_CODES[w.qtype], 0, LAYOUT_CODES[w.layout]]
        return [(w.data, [PART_AMX_BF16, *codes, 0, method.out_features])]
    if kind is QuantAmxInt8Method:
        assert method.packed is not None
        return [(method.packed, [PART_AMX_INT8, 0, 0, 0, 0, method.out_features])]
    if kind is QuantSplitMethod:
        parts = []
        for start, end, run in method.runs:
            if not isinstance(run, QuantKernelMethod):
                return None
            parts.append((run.weight.data, [*_int8_dot_codes(run), start, end]))
        return parts
    return None


def _int8_dot_codes(method: QuantKernelMethod) -> list[int]:
    """The first four codes of an int8-dot part: kind, qtype, isa, layout."""
    w = method.weight
    return [PART_INT8_DOT, QTYPE_CODES[w.qtype], ISA_CODES[method.isa], LAYOUT_CODES[w.layout]]


def build_fused_layers(layers: list[LlamaDecoderLayer], num_rows: int) -> FusedLayers | None:
    """The arguments for a step of ``num_rows`` rows, or None when some projection of some
    layer runs another method (or has a bias) at that row count, or some layer is not a
    plain ``LlamaDecoderLayer`` without q/k norms, experts (``moe``) or Gemma's parts."""
    if any(
        type(layer) is not LlamaDecoderLayer
        or layer.qk_norm is not None
        or layer.moe is not None
        or layer.attn_out_norm is not None
        or layer.gelu
        for layer in layers
    ):
        return None
    weights: list[torch.Tensor] = []
    codes: list[int] = []
    part_counts: list[int] = []
    for layer in layers:
        for name in PROJECTIONS:
            lin = getattr(layer, name)
            parts = projection_parts(lin.method_for(num_rows), num_rows)
            if parts is None or lin.bias is not None:
                return None
            for weight, part in parts:
                weights.append(weight)
                codes.extend(part)
            part_counts.append(len(parts))
    return FusedLayers(
        input_norms=[layer.input_layernorm for layer in layers],
        post_norms=[layer.post_attention_layernorm for layer in layers],
        weights=weights,
        parts=codes,
        part_counts=part_counts,
    )


class FusedModel(Protocol):
    """What ``run_fused_layers`` reads of the model (``llama.LlamaForCausalLM``)."""

    layers: Sequence[LlamaDecoderLayer]
    attn_backend: AttentionBackend
    ops: LayerOps
    fused_layers: bool  # whether a step may run every layer in one native call
    # By step row count: (the layers' linears_version, the call's arguments or None).
    fused_cache: dict[int, tuple[tuple[int, ...], FusedLayers | None]]


def run_fused_layers(
    model: FusedModel,
    hidden: torch.Tensor,  # [T, hidden] the embedded tokens (updated in place)
    cos: torch.Tensor,  # [T, 1, d]
    sin: torch.Tensor,  # [T, 1, d]
    kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kvh, d]
    meta: AttentionMetadata,
    views: StepViews,
) -> torch.Tensor | None:  # [T, hidden] the last layer's MLP output (``views.norm``)
    """Run every layer of ``model`` in one ``decode_layers`` call when this step
    allows it (module docstring); returns the last layer's MLP output, not yet added to
    ``hidden``, or None (nothing run) when the step must run layer by layer."""
    layers = model.layers
    backend = model.attn_backend
    if (
        not model.fused_layers
        or model.ops is not NATIVE_OPS
        or not isinstance(backend, NativeCPUBackend)
        or isinstance(hidden, FakeTensor)  # traced (memory plan): the layer-by-layer path
        or meta.logit_softcap is not None
    ):
        return None
    rows = backend.whole_step_tables(meta, kv_caches[0])
    if rows is None:
        return None
    num_rows = hidden.shape[0]
    for layer in layers:
        layer.ensure_linears()
    versions = tuple(layer.linears_version for layer in layers)
    cached = model.fused_cache.get(num_rows)
    if cached is None or cached[0] != versions:
        if cached is not None:
            # NOTE: every entry holds the old build's weights (a prepacked copy is a whole
            # weight); all of them are stale, not only this row count's.
            model.fused_cache.clear()
        # NOTE: a step that cannot fuse is remembered too, so it costs one lookup a step.
        built = build_fused_layers(list(layers), num_rows)
        cached = model.fused_cache[num_rows] = (versions, built)
    fused = cached[1]
    if fused is None:
        return None
    first = layers[0]
    tables, lens = rows
    torch.ops.kvserve.decode_layers(
        hidden,
        None,
        cos,
        sin,
        fused.input_norms,
        fused.post_norms,
        fused.weights,
        fused.parts,
        fused.part_counts,
        kv_caches,
        meta.slot_mapping,
        tables,
        lens,
        first.num_heads,
        first.eps,
        meta.scale if meta.scale is not None else 1.0 / math.sqrt(first.head_dim),
        meta.sliding_window or 0,
        meta.num_sink_tokens,
        views.norm,
        views.qkv,
        views.attn_rows,
        views.gate_up,
        views.act,
    )
    return views.norm
