"""HF tensor names and shapes of a Llama-family model, and state-dict validation."""

from __future__ import annotations

from typing import Any

import torch

from kvserve.config import ModelArchConfig
from kvserve.models.errors import ModelLoadError, positive_int  # noqa: F401 - re-exported
from kvserve.models.moe_weights import moe_layer_shapes

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accept a torch dtype or its name; only float32 / bfloat16 / float16 are allowed."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(SUPPORTED_DTYPES)}, got {dtype!r}")
        return SUPPORTED_DTYPES[name]
    if dtype not in SUPPORTED_DTYPES.values():
        raise ValueError(f"dtype must be one of {sorted(SUPPORTED_DTYPES)}, got {dtype!r}")
    return dtype


def check_heads(num_heads: int, num_kv_heads: int, key: str, path: str) -> None:
    """Raise ``ModelLoadError`` unless the KV heads divide the query heads (GQA groups)."""
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{path}: {key!r} ({num_kv_heads}) must divide the number of attention heads "
            f"({num_heads})"
        )


# Families whose checkpoints hold q/k/v as one ``qkv_proj`` and gate/up as one
# ``gate_up_proj`` tensor (rows in that order), split at load (``split_fused``).
FUSED_CHECKPOINT_ARCHS = frozenset({"phi3"})


def expected_shapes(
    arch: ModelArchConfig, *, checkpoint: bool = True
) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model under its HF name, with its shape (``[out, in]`` for linears).

    ``lm_head.weight`` is absent when the embeddings are tied; q/k/v biases are present only
    when ``arch.attention_bias`` (qwen2), q/k norms only when ``arch.qk_norm`` (qwen3, gemma3),
    the pre- and post-feedforward norms only when ``arch.sandwich_norms`` (gemma); a MoE
    layer has its router and per-expert tensors instead of the dense MLP's.
    ``checkpoint``: the names as a checkpoint of the family stores them (Phi-3's fused
    ``qkv_proj`` / ``gate_up_proj``); False: as ``split_fused`` hands them to the model.
    """
    h, i, v = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    q_dim = arch.num_attention_heads * arch.head_dim
    kv_dim = arch.num_key_value_heads * arch.head_dim
    fused = checkpoint and arch.architecture in FUSED_CHECKPOINT_ARCHS
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(arch.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        if fused:
            shapes[p + "self_attn.qkv_proj.weight"] = (q_dim + 2 * kv_dim, h)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (q_dim, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv_dim, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv_dim, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_dim)
        if arch.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_dim,)
        if arch.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (arch.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (arch.head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if arch.sandwich_norms:  # Gemma: the attention / MLP outputs' norms, the pre-MLP one
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if arch.is_moe_layer(layer):
            shapes.update(moe_layer_shapes(arch, p))  # router and experts (moe_weights.py)
        elif fused:
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * i, h)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (i, h)
            shapes[p + "mlp.up_proj.weight"] = (i, h)
        if not arch.is_moe_layer(layer):
            shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def check_shape(
    name: str,
    shape: tuple[int, ...],
    expected: dict[str, tuple[int, ...]],
    path: str,
    label: str | None = None,
) -> None:
    """Raise ``ModelLoadError`` if tensor ``name`` is unknown or its shape is not expected.

    ``label`` names the tensor in messages (default: ``name``), e.g. its name in the file.
    """
    label = label or repr(name)
    if name not in expected:
        raise ModelLoadError(f"{path}: unexpected tensor {label} for this architecture")
    if tuple(shape) != expected[name]:
        raise ModelLoadError(
            f"{path}: tensor {label} has shape {list(shape)}, but the config implies "
            f"{list(expected[name])}"
        )


def check_complete(
    names: set[str] | dict[str, object], expected: dict[str, tuple[int, ...]], path: str
) -> None:
    """Raise ``ModelLoadError`` listing the expected tensors that are missing."""
    missing = [n for n in expected if n not in names]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        )
        raise ModelLoadError(f"{path}: {len(missing)} tensor(s) missing: {shown}")


def split_fused(state_dict: dict[str, Any], arch: ModelArchConfig) -> dict[str, Any]:
    """``state_dict`` with each fused ``qkv_proj`` / ``gate_up_proj`` tensor (Phi-3) split
    into the q/k/v and gate/up tensors of the same rows (views, no copy; a quantized one by
    whole rows of blocks); others kept.

    NOTE: the model fuses them again at load (``LlamaForCausalLM.load_weights``); the split
    keeps one naming for the model, the quantizer and the tensor-parallel sharding.
    """
    q_dim = arch.num_attention_heads * arch.head_dim
    kv_dim = arch.num_key_value_heads * arch.head_dim
    inter = arch.intermediate_size
    out: dict[str, Any] = {}
    for name, tensor in state_dict.items():
        if name.endswith(".self_attn.qkv_proj.weight"):
            p = name.removesuffix("qkv_proj.weight")
            q, k, v = _split_rows(tensor, [q_dim, kv_dim, kv_dim])
            out.update({p + "q_proj.weight": q, p + "k_proj.weight": k, p + "v_proj.weight": v})
        elif name.endswith(".mlp.gate_up_proj.weight"):
            p = name.removesuffix("gate_up_proj.weight")
            gate, up = _split_rows(tensor, [inter, inter])
            out.update({p + "gate_proj.weight": gate, p + "up_proj.weight": up})
        else:
            out[name] = tensor
    return out


def _split_rows(tensor: Any, sizes: list[int]) -> list[Any]:
    if isinstance(tensor, torch.Tensor):
        return list(torch.split(tensor, sizes))
    return tensor.split_rows(sizes)  # a QuantizedWeight


def join_fused(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``split_fused`` on dense tensors: q/k/v rows as one ``qkv_proj`` and
    gate/up rows as one ``gate_up_proj`` (a Phi-3 checkpoint's names)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name.endswith(".self_attn.q_proj.weight"):
            p = name.removesuffix("q_proj.weight")
            parts = [state_dict[p + f"{x}_proj.weight"] for x in "qkv"]
            out[p + "qkv_proj.weight"] = torch.cat(parts)
        elif name.endswith(".mlp.gate_proj.weight"):
            p = name.removesuffix("gate_proj.weight")
            parts = [state_dict[p + "gate_proj.weight"], state_dict[p + "up_proj.weight"]]
            out[p + "gate_up_proj.weight"] = torch.cat(parts)
        elif not name.endswith(
            (".self_attn.k_proj.weight", ".self_attn.v_proj.weight", ".mlp.up_proj.weight")
        ):
            out[name] = tensor
    return out
