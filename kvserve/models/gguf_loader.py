"""GGUF files (llama.cpp format) -> ModelArchConfig + HF-named state dict."""

from __future__ import annotations

import math
import re

import torch

from kvserve.config import ModelArchConfig
from kvserve.models.dequant import dequantize, single_threaded
from kvserve.models.errors import ModelLoadError
from kvserve.models.gemma_config import GEMMA_ARCHS, gemma_gguf_fields
from kvserve.models.gguf_reader import GGUFArray, GGUFFile, GGUFTensorInfo, read_gguf
from kvserve.models.moe_weights import (
    check_stacked,
    gguf_moe_fields,
    is_stacked,
    stacked_names,
    unstack_experts,
)
from kvserve.models.quant import (
    DENSE_GGUF_TYPES,
    KERNEL_QTYPES,
    QuantizedWeight,
    from_gguf,
    quantize_dense,
)
from kvserve.models.weights import (
    check_complete,
    check_heads,
    check_shape,
    expected_shapes,
    positive_int,
    split_fused,
)

# GGUF general.architecture -> our architecture name. NOTE: llama.cpp's converter writes
# Mistral / SmolLM checkpoints as "llama" (with permuted q/k), so there is no "mistral" here.
# A "llama" file with experts (``llama.expert_count``) is Mixtral.
SUPPORTED_GGUF_ARCHS = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "qwen2moe": "qwen2moe",
    "qwen3moe": "qwen3moe",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
}
# Phi-3's LongRoPE factors, stored as tensors (read into the config, not weights).
_ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# NOTE: Llama 3.x's llama3 RoPE scaling, as llama.cpp's converter stores it: one divisor per
# frequency (the llama3 parameters themselves are not kept in the file).
_ROPE_FREQS = "rope_freqs.weight"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # phi3: q, k, v rows
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # Mixture of experts: the router, the experts stacked [E, out, in] (split at load,
    # moe_weights.py) and Qwen2-MoE's shared expert with its gate.
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# Gemma's four norms a layer: llama.cpp's ffn_norm is the one before the MLP (Gemma's
# pre_feedforward_layernorm; Llama's post_attention_layernorm).
_GEMMA_LAYER_NAMES = _LAYER_NAMES | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str, gguf_arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor name, or None if it is not a llama-family tensor.

    NOTE: llama.cpp's phi3 ``ffn_up`` is Phi-3's fused ``gate_up_proj`` (gate rows first).
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    names = _GEMMA_LAYER_NAMES if gguf_arch in GEMMA_ARCHS else _LAYER_NAMES
    if match and match.group(2) in names:
        name = names[match.group(2)]
        if gguf_arch == "phi3" and name == "mlp.up_proj.weight":
            name = "mlp.gate_up_proj.weight"
        return f"model.layers.{match.group(1)}.{name}"
    return None


def gguf_arch_config(gguf: GGUFFile) -> ModelArchConfig:
    """Read the model's shapes from the GGUF metadata (``{arch}.block_count`` and friends)."""
    md, path = gguf.metadata, gguf.path
    gguf_arch = md.get("general.architecture")
    if gguf_arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {gguf_arch!r} "
            f"(supported: {', '.join(sorted(SUPPORTED_GGUF_ARCHS))})"
        )

    def get(key: str, default: object = None, required: bool = True) -> object:
        full = f"{gguf_arch}.{key}"
        if full in md:
            return md[full]
        if required and default is None:
            raise ModelLoadError(f"{path}: GGUF metadata key {full!r} is missing")
        return default

    def size(key: str, default: int | None = None) -> int:
        return positive_int(get(key, default), f"{gguf_arch}.{key}", path)

    hidden = size("embedding_length")
    num_heads = size("attention.head_count")
    num_kv_heads = size("attention.head_count_kv", num_heads)
    check_heads(num_heads, num_kv_heads, f"{gguf_arch}.attention.head_count_kv", path)
    head_dim = size("attention.key_length", hidden // num_heads)
    rope_dim = get("rope.dimension_count", head_dim)
    if int(rope_dim) != head_dim:
        raise ModelLoadError(
            f"{path}: partial rotary embeddings (rope.dimension_count {rope_dim} != head_dim "
            f"{head_dim}) are not supported"
        )
    vocab = get("vocab_size", None, required=False)
    if vocab is None:
        tokens = md.get("tokenizer.ggml.tokens")
        if isinstance(tokens, GGUFArray):
            vocab = tokens.length
        elif "token_embd.weight" in gguf.tensors:
            vocab = gguf.tensors["token_embd.weight"].shape[0]
        else:
            raise ModelLoadError(f"{path}: cannot tell the vocabulary size")
    sliding = get("attention.sliding_window", None, required=False)
    moe = gguf_moe_fields(md, gguf_arch, set(gguf.tensors), size("block_count"), path)
    name = "mixtral" if moe and gguf_arch == "llama" else SUPPORTED_GGUF_ARCHS[gguf_arch]
    # NOTE: a Qwen-MoE file may carry only the experts' width (every layer routed).
    ffn = get("feed_forward_length", None, required=not moe) or moe["moe_intermediate_size"]
    extra = {}
    if gguf_arch in GEMMA_ARCHS:
        extra = gemma_gguf_fields(
            lambda key: get(key, None, required=False),
            gguf_arch,
            size("block_count"),
            (hidden, num_heads, head_dim, size("context_length")),
            path,
        )
    fields = dict(
        architecture=name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=positive_int(ffn, f"{gguf_arch}.feed_forward_length", path),
        num_hidden_layers=size("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=size("context_length"),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(gguf, gguf_arch, head_dim, size("context_length")),
        # NOTE: llama.cpp's converter drops output.weight when it equals the embedding.
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias=gguf_arch in ("qwen2", "qwen2moe"),
        qk_norm=gguf_arch in ("qwen3", "qwen3moe"),
        # NOTE: a window past the context (Phi-3-128k's 262144) never slides.
        sliding_window=int(sliding) if sliding and sliding < size("context_length") else None,
        bos_token_id=_opt_int(md.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_opt_int(md.get("tokenizer.ggml.eos_token_id")),
        **moe,
    )
    try:
        return ModelArchConfig(**(fields | extra))
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e


def _rope_scaling(gguf: GGUFFile, gguf_arch: str, head_dim: int, context: int) -> dict | None:
    md, path = gguf.metadata, gguf.path
    if any(name in gguf.tensors for name in _ROPE_FACTOR_TENSORS):
        return _longrope(gguf, gguf_arch, head_dim, context)
    kind = md.get(f"{gguf_arch}.rope.scaling.type", "none")
    if _ROPE_FREQS in gguf.tensors:
        if kind not in ("none", None):
            raise ModelLoadError(
                f"{path}: both a {_ROPE_FREQS!r} tensor and rope scaling type {kind!r}"
            )
        factors = _rope_factor_tensor(gguf, _ROPE_FREQS, head_dim)
        return {"rope_type": "freq_factors", "freq_factors": factors}
    if kind in ("none", None):
        return None
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(f"{path}: unsupported rope scaling type {kind!r}")
    scaling: dict = {"rope_type": kind, "factor": float(md[f"{gguf_arch}.rope.scaling.factor"])}
    original = md.get(f"{gguf_arch}.rope.scaling.original_context_length")
    if original is None and kind == "yarn":
        original = context  # NOTE: llama.cpp's default for yarn_orig_ctx: the trained context
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _longrope(gguf: GGUFFile, gguf_arch: str, head_dim: int, context: int) -> dict:
    """Phi-3's LongRoPE from llama.cpp's ``rope_factors_{long,short}`` tensors and
    ``rope.scaling.original_context_length`` (as ``convert_hf_to_gguf.py`` writes them)."""
    md, path = gguf.metadata, gguf.path
    factors = {}
    for name, key in zip(_ROPE_FACTOR_TENSORS, ("long_factor", "short_factor"), strict=True):
        if name not in gguf.tensors:
            raise ModelLoadError(f"{path}: {name!r} is missing (LongRoPE needs both factors)")
        factors[key] = _rope_factor_tensor(gguf, name, head_dim)
    original_key = f"{gguf_arch}.rope.scaling.original_context_length"
    if original_key not in md:
        raise ModelLoadError(f"{path}: GGUF metadata key {original_key!r} is missing")
    original = positive_int(md[original_key], original_key, path)
    scaling = {"rope_type": "longrope", **factors, "original_max_position_embeddings": original}
    stored = md.get(f"{gguf_arch}.rope.scaling.attn_factor")
    scale = context / original
    derived = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original))
    # NOTE: the converter stores transformers' value as float32; derived again in float64
    # unless the file says otherwise (cos / sin then equal transformers' bit for bit).
    if stored is not None and abs(float(stored) - derived) > 1e-6 * derived:
        scaling["attention_factor"] = float(stored)
    return scaling


def _rope_factor_tensor(gguf: GGUFFile, name: str, head_dim: int) -> list[float]:
    """A RoPE factor tensor's values (one per frequency: ``head_dim / 2`` of them)."""
    info = gguf.tensors[name]
    if info.shape != (head_dim // 2,):
        raise ModelLoadError(
            f"{gguf.path}: tensor {name!r} has shape {list(info.shape)}, but the head size "
            f"implies [{head_dim // 2}]"
        )
    values = dequantize(info.data, info.ggml_type, info.shape, torch.float32, path=gguf.path)
    return values.tolist()


def _opt_int(value: object) -> int | None:
    return None if value is None or isinstance(value, GGUFArray) else int(value)


def unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE -> HF rotate-half layout).

    llama.cpp's converter reorders each head's rows from [x0..x_{d/2-1}, y0..y_{d/2-1}] to
    [x0, y0, x1, y1, ...]; this is the inverse. Works for weights [rows, in] and biases [rows].
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    tail = weight.shape[1:]
    # [num_heads, half, 2, *tail] -> [num_heads, 2, half, *tail]
    return weight.reshape(num_heads, half, 2, *tail).transpose(1, 2).reshape(rows, *tail)


def load_gguf(
    path: str, dtype: torch.dtype, quantization: str = "none"
) -> tuple[ModelArchConfig, dict[str, torch.Tensor | QuantizedWeight]]:
    """Read a GGUF file: its architecture and all weights under their HF names.

    ``quantization``: "none" dequantizes every tensor to ``dtype``; "auto" keeps the
    quantized 2-D tensors (embedding and linear weights) as ``QuantizedWeight`` in their
    block format (K-quants repacked, see ``kvserve.models.quant``) and dense ones dense;
    "q8_0" / "q4_0" / "q4_1" keeps tensors of that type and quantizes the other 2-D ones
    to it (dequantizing first: lossy for quantized ones). 1-D tensors are always dense.
    """
    gguf = read_gguf(path)
    arch = gguf_arch_config(gguf)
    expected = expected_shapes(arch)
    # Validate every name and shape before spending time on dequantisation.
    gguf_arch = gguf.metadata["general.architecture"]
    names: dict[str, str] = {}
    provided: set[str] = set()  # the HF names the tensors give (stacked experts: each)
    for name, info in gguf.tensors.items():
        if name in _ROPE_FACTOR_TENSORS or name == _ROPE_FREQS:
            continue  # read into arch.rope_scaling
        target = hf_name(name, gguf_arch)
        if target is None:
            raise ModelLoadError(
                f"{path}: unexpected GGUF tensor {name!r} for a llama-family model"
            )
        label = f"{name!r} ({target})"
        if is_stacked(target):
            check_stacked(target, info.shape, arch, path, label=label)
            provided.update(stacked_names(target, arch))
        else:
            check_shape(target, _hf_shape(target, info.shape), expected, path, label=label)
            provided.add(target)
        names[target] = name
    check_complete(provided, expected, path)

    # NOTE: only the "llama" converter permutes q/k (interleaved RoPE); qwen2 uses NeoX RoPE.
    permuted = gguf_arch == "llama"
    state_dict: dict[str, torch.Tensor | QuantizedWeight] = {}
    with single_threaded():
        for target, name in names.items():
            info = gguf.tensors[name]
            if is_stacked(target):  # one 2-D tensor per expert: whole rows of blocks
                experts = [
                    _load_tensor(_expert(info, e, arch.num_experts), dtype, quantization, path)
                    for e in range(arch.num_experts)
                ]
                state_dict.update(unstack_experts(target, experts, arch))
                continue
            tensor = _load_tensor(info, dtype, quantization, path)
            if target.endswith(".shared_expert_gate.weight") and tensor.dim() == 1:
                tensor = tensor.reshape(1, -1)  # llama.cpp's [h] for HF's [1, h]
            if permuted and ".self_attn.q_proj." in target:
                tensor = _unpermute(tensor, arch.num_attention_heads)
            elif permuted and ".self_attn.k_proj." in target:
                tensor = _unpermute(tensor, arch.num_key_value_heads)
            elif arch.norm_weight_offset and target.endswith("norm.weight"):
                # NOTE: llama.cpp's converter stores Gemma's norm weights as w + 1: HF's w
                # again (the model adds the 1 back; exact in float32 for w + 1 >= 0.5).
                assert isinstance(tensor, torch.Tensor)  # 1-D: always dense
                tensor = tensor - arch.norm_weight_offset
            state_dict[target] = tensor
    return arch, split_fused(state_dict, arch)


def _hf_shape(target: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of a GGUF tensor's ``shape`` (llama.cpp may write Qwen2-MoE's
    shared-expert gate ``[1, h]`` as ``[h]``)."""
    if target.endswith(".shared_expert_gate.weight") and len(shape) == 1:
        return (1, *shape)
    return shape


def _expert(info: GGUFTensorInfo, index: int, num_experts: int) -> GGUFTensorInfo:
    """Expert ``index``'s 2-D slice of a stacked ``[E, out, in]`` tensor (its bytes: the
    rows of blocks of one expert are contiguous)."""
    size = info.data.size // num_experts
    data = info.data[index * size : (index + 1) * size]
    return GGUFTensorInfo(f"{info.name}[{index}]", info.shape[1:], info.ggml_type, data)


def _load_tensor(
    info: GGUFTensorInfo, dtype: torch.dtype, quantization: str, path: str
) -> torch.Tensor | QuantizedWeight:
    """One tensor as ``quantization`` asks (see ``load_gguf``)."""
    name, kind = info.name, info.ggml_type
    if quantization == "none" or len(info.shape) != 2:
        return dequantize(info.data, kind, info.shape, dtype, name=name, path=path)
    if quantization == "auto":
        if kind in DENSE_GGUF_TYPES:
            return dequantize(info.data, kind, info.shape, dtype, name=name, path=path)
        return from_gguf(info.data, kind, info.shape, name=name, path=path)
    if KERNEL_QTYPES[quantization] == kind:
        return from_gguf(info.data, kind, info.shape, name=name, path=path)
    dense = dequantize(info.data, kind, info.shape, torch.float32, name=name, path=path)
    return quantize_dense(dense, quantization)


def _unpermute(
    tensor: torch.Tensor | QuantizedWeight, num_heads: int
) -> torch.Tensor | QuantizedWeight:
    # NOTE: a row permutation moves whole rows of blocks, so quantized rows move as bytes.
    if isinstance(tensor, QuantizedWeight):
        return tensor.with_rows(unpermute_rope(tensor.data, num_heads))
    return unpermute_rope(tensor, num_heads)
