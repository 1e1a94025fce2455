"""Quantized weights in the Llama model: which projections hold blocks instead of parameters.

``LlamaForCausalLM.load_weights`` hands the ``QuantizedWeight`` entries of a state dict to
``attach_quantized``: each fused projection (qkv, o, gate_up, down) with a quantized part gets
its weight source in ``layer.quantized[name]`` (one ``QuantizedWeight`` when the parts share
a format, else ``QuantizedParts``), the embedding and the lm_head in ``model.quantized``; the
dense parameters they replace are dropped (0 elements), so only the blocks stay resident.
Each source is repacked once to the byte layout its kernel reads fastest (``kernel_layout``:
``x16`` on AVX-512 VNNI and AVX2; a K-quant stays as the file stores it).
The projections' ``Linear``s are then built from these sources (``kvserve.models.quant_linear``
registers their methods); the embedding looks rows up with ``embedding_lookup``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kvserve.models.hub import hub_id_of_path
from kvserve.models.quant import QuantizedWeight

# Projection name -> its HF weight names (rows stacked in this order).
_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o": ("self_attn.o_proj.weight",),
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down": ("mlp.down_proj.weight",),
}


def _dropped(like: torch.Tensor) -> nn.Parameter:
    """A 0-element parameter keeping ``like``'s dtype and device (what ``.to()`` moves)."""
    return nn.Parameter(torch.empty(0, dtype=like.dtype, device=like.device), requires_grad=False)


def attach_quantized(
    model: Any,  # LlamaForCausalLM
    quantized: Mapping[str, QuantizedWeight],
    state_dict: Mapping[str, Any],
) -> None:
    """Give ``model`` the quantized weight sources of ``quantized`` (HF names)."""
    from kvserve.models.quant_linear import fuse_weights, kernel_layout

    emb = quantized.get("model.embed_tokens.weight")
    if emb is not None:
        emb = kernel_layout(emb)
        model.quantized["embed_tokens"] = emb
        model.embed_tokens = _dropped(model.embed_tokens)
        if model.arch.tie_word_embeddings:
            model.quantized["lm_head"] = emb
            model.lm_head = model.embed_tokens
    head = quantized.get("lm_head.weight")
    if head is not None and not model.arch.tie_word_embeddings:
        model.quantized["lm_head"] = kernel_layout(head)
        model.lm_head = _dropped(model.lm_head)
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        for proj, names in _PROJECTIONS.items():
            full = [prefix + n for n in names]
            if not any(n in quantized for n in full):
                continue
            layer.quantized[proj] = kernel_layout(fuse_weights([state_dict[n] for n in full]))
            setattr(layer, f"{proj}_weight", _dropped(getattr(layer, f"{proj}_weight")))


def quantized_sources(model: Any) -> list[Any]:
    """The distinct quantized weight sources of ``model`` (a tied table once)."""
    seen: dict[int, Any] = {}
    for source in model.quantized.values():
        seen.setdefault(id(source), source)
    for layer in model.layers:
        for source in layer.quantized.values():
            seen.setdefault(id(source), source)
    return list(seen.values())


def quantized_nbytes(model: Any) -> int:
    """Bytes held by ``model``'s quantized weights (blocks and dense parts of mixed ones)."""
    return sum(source.nbytes for source in quantized_sources(model))


def decode_weight_bytes(model: Any) -> int:
    """Bytes of weights one decode step reads: every parameter once.

    An untied input embedding is left out (a step reads only its T rows); a tied one is read
    whole by the lm_head and counted once.
    """
    total = 0
    for name, p in model.named_parameters():  # NOTE: yields a tied tensor once
        if name == "embed_tokens" and model.lm_head is not model.embed_tokens:
            continue
        total += p.numel() * p.element_size()
    return total + model.released_weight_bytes()  # held only as prepacked copies


def quantized_decode_bytes(model: Any) -> int:
    """Quantized bytes one decode step reads: all but an untied embedding (T rows of it)."""
    emb = model.quantized.get("embed_tokens")
    skip = emb if emb is not None and model.quantized.get("lm_head") is not emb else None
    return sum(s.nbytes for s in quantized_sources(model) if s is not skip)


def quantization_summary(model: Any, requested: str) -> dict[str, Any]:
    """What ``stats()`` and the start-up line report: the mode and the weight bytes by format.

    ``formats``: held format (``q4_1``, ``q8_0``, ``dense``) -> bytes; ``kernels``: the
    instruction set the int8-dot kernels run with (None when they are unavailable);
    ``layouts``: byte layout (``plain``, ``x16``) -> bytes; ``dense_copy_bytes``: the dense
    copies of quantized weights that the kernel selection chose for some M bucket
    (``dequant_*``, held beside the blocks; part of the memory report's weights).
    """
    from kvserve.runtime.native import quant_ops

    formats: dict[str, int] = {}
    for source in quantized_sources(model):
        parts = getattr(source, "parts", (source,))
        for part in parts:
            key = part.qtype if isinstance(part, QuantizedWeight) else "dense"
            nbytes = (
                part.nbytes
                if isinstance(part, QuantizedWeight)
                else part.numel() * part.element_size()
            )
            formats[key] = formats.get(key, 0) + nbytes
    # NOTE: dense weights held only as prepacked copies (freed parameters) count too.
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    dense += model.released_weight_bytes()
    formats["dense"] = formats.get("dense", 0) + dense
    kernels = quant_ops.best_isa() if formats.keys() - {"dense"} and quant_ops.available() else None
    return {
        "mode": requested,
        "weight_bytes_by_format": formats,
        "kernels": kernels,
        "layouts": quantized_layouts(model),
        "dense_copy_bytes": dense_copy_nbytes(model),
    }


def quantized_layouts(model: Any) -> dict[str, int]:
    """Byte layout of the quantized blocks (``plain`` / ``x16``) -> bytes held in it."""
    layouts: dict[str, int] = {}
    for source in quantized_sources(model):
        for part in getattr(source, "parts", (source,)):
            if isinstance(part, QuantizedWeight):
                layouts[part.layout] = layouts.get(part.layout, 0) + part.nbytes
    return layouts


def dense_copy_nbytes(model: Any) -> int:
    """Bytes of the dense copies held for quantized projections (chosen for some M bucket)."""
    from kvserve.models.quant_linear import is_quantized

    if not quantized_sources(model):
        return 0
    return sum(lin.extra_nbytes for lin in model.linears() if is_quantized(lin.source))


def summary_line(summary: dict[str, Any]) -> str:
    """One line for the start-up log: ``quantization auto: q4_1 66.4 MB, ...``."""
    parts = ", ".join(
        f"{name} {nbytes / 1e6:.1f} MB"
        for name, nbytes in sorted(summary["weight_bytes_by_format"].items())
    )
    kernels = f"; int8-dot kernels: {summary['kernels']}" if summary["kernels"] else ""
    layouts = summary.get("layouts") or {}
    if layouts.get("x16"):
        kernels += f" (x16 layout: {layouts['x16'] / 1e6:.1f} MB)"
    copies = summary.get("dense_copy_bytes", 0)
    if copies:
        kernels += f"; dense copies of quantized weights {copies / 1e6:.1f} MB (chosen for large M)"
    return f"quantization {summary['mode']}: weights {parts}{kernels}"


# A GGUF file name's weight-format tag: ``.Q4_1``, ``-Q4_K_M``, ``.IQ2_XS``, ``-f16``, ``.BF16``.
_FORMAT_TAG = re.compile(r"[.\-_](?:I?Q\d+(?:_[A-Z0-9]+)*|F16|F32|BF16)$", re.IGNORECASE)


def model_id(model_path: str | None, summary: Mapping[str, Any] | None = None) -> str:
    """The model's name as run: its file or directory name without ``.gguf``, with the weight
    format tag of the weights as held (``summary``: ``quantization_summary``).

    A GGUF's own tag (``SmolLM2-135M-Instruct.Q4_1``) stays while its tensors run as stored
    (``auto``); weights dequantized at load (``none``) drop it, weights quantized at load to
    a format (``q8_0``) carry that format's: ``SmolLM2-135M-Instruct.Q8_0``. A snapshot
    folder of the Hugging Face cache is named by its Hub id (``Qwen/Qwen2.5-0.5B-Instruct``),
    as vLLM serves a model named by its Hub id.
    """
    hub_id = hub_id_of_path(str(model_path)) if model_path else None
    name = hub_id or os.path.basename(str(model_path or "kvserve-model").rstrip("/\\"))
    name = name[: -len(".gguf")] if name.lower().endswith(".gguf") else name
    if summary is None:
        return name
    held = set(summary.get("weight_bytes_by_format", {})) - {"dense"}
    mode = summary.get("mode", "auto")
    if held and mode == "auto":
        return name  # the file's tensors as stored
    base = _FORMAT_TAG.sub("", name) or name
    if held and mode in held:
        return f"{base}.{mode.upper()}"
    return base if not held else name
