"""Tiny random-weight GGUF files for tests, as llama.cpp's converter writes them: the same
weights as ``tests.tiny_models.make_tiny_model`` (see that module's docstring).

    from tests.tiny_gguf import make_tiny_gguf
    gguf_path = make_tiny_gguf(tmp_path, "llama", tensor_type="Q4_0")
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvserve.models.gemma_config import default_layer_types
from tests.tiny_models import GEMMA_ARCHS, _unique_dir, tiny_state_dict, tiny_tokenizer_dir


def _permute_for_gguf(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (HF -> interleaved RoPE)."""
    rows = weight.shape[0]
    shape = (num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return weight.reshape(shape).swapaxes(1, 2).reshape(weight.shape)


_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",  # qwen3
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # phi3
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # phi3: gate rows, then up rows
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # Mixture of experts (transformers 5 holds the experts stacked: split by _moe_for_gguf).
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_proj": "ffn_gate_exps.weight",
    "mlp.experts.up_proj": "ffn_up_exps.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
# Gemma's four norms a layer, as llama.cpp names them (its ffn_norm is the pre-MLP one).
_GGUF_GEMMA_NORMS = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "mixtral": "llama"}
_GGUF_ARCH |= {"qwen2moe": "qwen2moe", "qwen3moe": "qwen3moe", "gemma2": "gemma2"}
_GGUF_ARCH |= {"gemma3": "gemma3"}


def _moe_for_gguf(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked ``experts.gate_up_proj`` [E, 2I, h] as llama.cpp's separate
    gate and up stacks; the shared-expert gate [1, h] as the [h] llama.cpp loads."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        elif name.endswith("shared_expert_gate.weight"):
            out[name] = tensor.reshape(-1)
        else:
            out[name] = tensor
    return out


def gguf_tensor_name(hf_name: str, gguf_arch: str = "llama") -> str:
    """The llama.cpp name of an HF tensor name (model.layers.3.mlp.up_proj.weight -> ...)."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    if gguf_arch in GEMMA_ARCHS and rest in _GGUF_GEMMA_NORMS:
        return f"blk.{layer}.{_GGUF_GEMMA_NORMS[rest]}"
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[rest]}"


def _gguf_metadata(gguf_arch: str, config: Any) -> dict[str, Any]:
    a = gguf_arch
    rope = config.rope_parameters
    extra: dict[str, Any] = {}
    if rope.get("rope_type") in ("linear", "yarn"):  # as the converter writes them
        extra[f"{a}.rope.scaling.type"] = rope["rope_type"]
        extra[f"{a}.rope.scaling.factor"] = float(rope["factor"])
        if rope.get("original_max_position_embeddings"):
            original = rope["original_max_position_embeddings"]
            extra[f"{a}.rope.scaling.original_context_length"] = original
    if a in GEMMA_ARCHS:
        extra |= _gemma_metadata(a, config)
    if a == "phi3":  # as convert_hf_to_gguf.py's Phi3MiniModel writes them
        original = rope.get("original_max_position_embeddings", config.max_position_embeddings)
        extra[f"{a}.rope.scaling.original_context_length"] = original
        extra[f"{a}.attention.sliding_window"] = config.sliding_window or 0
        if rope.get("long_factor"):
            scale = config.max_position_embeddings / original
            attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            extra[f"{a}.rope.scaling.attn_factor"] = attn
    return extra | {
        "general.architecture": a,
        "general.name": f"tiny-{a}",
        f"{a}.block_count": config.num_hidden_layers,
        f"{a}.context_length": config.max_position_embeddings,
        f"{a}.embedding_length": config.hidden_size,
        f"{a}.feed_forward_length": config.intermediate_size,
        f"{a}.attention.head_count": config.num_attention_heads,
        f"{a}.attention.head_count_kv": config.num_key_value_heads,
        f"{a}.attention.key_length": config.head_dim,
        f"{a}.attention.value_length": config.head_dim,
        f"{a}.rope.dimension_count": config.head_dim,
        # NOTE: Gemma 3 nests its RoPE per layer type; the file's base is the full layers'.
        f"{a}.rope.freq_base": float(rope.get("full_attention", rope)["rope_theta"]),
        f"{a}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        f"{a}.vocab_size": config.vocab_size,
        **_moe_metadata(a, config),
        "tokenizer.ggml.bos_token_id": config.bos_token_id,
        "tokenizer.ggml.eos_token_id": config.eos_token_id,
    }


def _gemma_metadata(a: str, config: Any) -> dict[str, Any]:
    """The keys convert_hf_to_gguf.py's Gemma2Model / Gemma3Model write."""
    rope = config.rope_parameters
    extra: dict[str, Any] = {}
    if config.sliding_window:
        extra[f"{a}.attention.sliding_window"] = config.sliding_window
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, key, None) is not None:
            extra[f"{a}.{key}"] = float(getattr(config, key))
    # NOTE: not written by the converter (llama.cpp derives them); only where the tiny
    # model differs from that: an attention scale not head_dim's, a local RoPE base
    # other than 10000 (the keys llama.cpp reads where present).
    if config.query_pre_attn_scalar != config.head_dim:
        extra[f"{a}.attention.scale"] = float(config.query_pre_attn_scalar) ** -0.5
    local = (rope.get("sliding_attention") or {}).get("rope_theta", 10000.0)
    if a == "gemma3" and local != 10000.0:
        extra[f"{a}.rope.freq_base_swa"] = float(local)
    types = tuple(config.layer_types)
    if types != default_layer_types(a, len(types)):  # llama.cpp's fixed pattern (2 / 6)
        periods = [
            n for n in range(1, len(types) + 2) if default_layer_types(a, len(types), n) == types
        ]
        if not periods:
            raise ValueError(f"layer_types {types} have no period a GGUF file can state")
        extra[f"{a}.attention.sliding_window_pattern"] = periods[0]
    if a == "gemma3":
        full = rope.get("full_attention") or {}
        if full.get("rope_type") == "linear":
            extra[f"{a}.rope.scaling.type"] = "linear"
            extra[f"{a}.rope.scaling.factor"] = float(full["factor"])
    return extra


def _llama3_rope_freqs(config: Any) -> np.ndarray:
    """Llama 3.x's RoPE scaling as llama.cpp's converter stores it: a divisor per frequency
    (``rope_freqs``), computed from the llama3 parameters in Python floats."""
    rope = config.rope_parameters
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    dims = np.arange(0, config.head_dim, 2, dtype=np.float32) / config.head_dim
    freqs = 1.0 / (np.float32(rope["rope_theta"]) ** dims)
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _moe_metadata(a: str, config: Any) -> dict[str, Any]:
    """The expert keys llama.cpp's converter writes (none for a dense model)."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)
    if not experts:
        return {}
    out = {f"{a}.expert_count": experts, f"{a}.expert_used_count": config.num_experts_per_tok}
    if a != "llama":  # Mixtral's experts are intermediate_size wide
        out[f"{a}.expert_feed_forward_length"] = config.moe_intermediate_size
    if getattr(config, "shared_expert_intermediate_size", 0):
        out[f"{a}.expert_shared_feed_forward_length"] = config.shared_expert_intermediate_size
    return out


def make_tiny_gguf(
    tmp_dir: str | os.PathLike,
    arch: str = "llama",
    *,
    tensor_type: str = "Q8_0",
    tensor_types: dict[str, str] | None = None,
    metadata: dict[str, Any] | None = None,
    drop_tensors: tuple[str, ...] = (),
    name: str | None = None,
    seed: int = 0,
    tokenizer: bool = False,
    **overrides: Any,
) -> str:
    """Write a tiny random-weight llama.cpp-style GGUF under ``tmp_dir``; returns its path.

    Same weights as ``make_tiny_model(tmp_dir, arch, seed=seed, **overrides)``. ``arch``
    "llama" / "smollm" / "mistral" / "mixtral" are written as GGUF arch "llama" (q/k
    permuted), "qwen2", "qwen3", "phi3", "qwen2moe" and "qwen3moe" under their own names as
    llama.cpp's converter writes them (Phi-3's fused qkv as ``attn_qkv``, gate/up as
    ``ffn_up``, LongRoPE factors as ``rope_factors_{long,short}`` tensors, a llama3 RoPE as
    ``rope_freqs``, experts stacked as ``ffn_{gate,up,down}_exps``, routers F32; Gemma's
    norms as w + 1). 1-D
    tensors are F32; others ``tensor_type`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
    ...; Q4_K, Q5_K and Q6_K by ``kvserve.models.kquant_ref``: rows of 256 values). For
    error tests: ``tensor_types`` overrides the type per GGUF tensor name (types gguf cannot
    quantise get random bytes of the right size), ``metadata`` adds or replaces keys (None
    deletes one), ``drop_tensors`` omits tensors. ``tokenizer=True`` writes the embedded
    tokenizer's metadata (``tests/gguf_tokenizer.py``): an engine can serve the file.
    """
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
    from gguf import quants as gguf_quants

    from kvserve.models.kquant_ref import quantize_kquant

    kquant_types = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K)
    kquant_types += (GGMLQuantizationType.Q6_K,)

    state_dict, config = tiny_state_dict(arch, seed=seed, **overrides)
    gguf_arch = _GGUF_ARCH.get(arch, "llama")
    state_dict = _moe_for_gguf(state_dict)
    path = Path(tmp_dir) / name if name else _unique_dir(tmp_dir, f"tiny-{arch}", ".gguf")
    path.parent.mkdir(parents=True, exist_ok=True)
    kv = _gguf_metadata(gguf_arch, config)
    for key, value in (metadata or {}).items():
        if value is None:
            kv.pop(key, None)
        else:
            kv[key] = value

    writer = GGUFWriter(str(path), arch=kv.get("general.architecture", gguf_arch))
    for key, value in kv.items():
        if key == "general.architecture":
            continue  # written by GGUFWriter itself
        if isinstance(value, bool):
            writer.add_key_value(key, value, GGUFValueType.BOOL)
        elif isinstance(value, int):
            writer.add_key_value(key, value, GGUFValueType.UINT32)
        elif isinstance(value, float):
            writer.add_key_value(key, value, GGUFValueType.FLOAT32)
        else:
            writer.add_key_value(key, str(value), GGUFValueType.STRING)
    if tokenizer:
        from tests.gguf_tokenizer import add_gguf_tokenizer

        add_gguf_tokenizer(writer, tiny_tokenizer_dir())

    rng = np.random.default_rng(seed)
    rope = config.rope_parameters
    if gguf_arch == "llama" and rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(config))
    if gguf_arch == "phi3" and rope.get("long_factor"):
        for kind in ("long", "short"):
            factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
            if f"rope_factors_{kind}.weight" not in drop_tensors:
                writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    for hf_name, tensor in state_dict.items():
        gname = gguf_tensor_name(hf_name, gguf_arch)
        if gname in drop_tensors:
            continue
        data = tensor.numpy().astype(np.float32)
        if gguf_arch in GEMMA_ARCHS and hf_name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # NOTE: the converter stores Gemma's norms as w + 1
        if gguf_arch == "llama" and gname.endswith("attn_q.weight"):
            data = _permute_for_gguf(data, config.num_attention_heads)
        elif gguf_arch == "llama" and gname.endswith("attn_k.weight"):
            data = _permute_for_gguf(data, config.num_key_value_heads)
        # NOTE: llama.cpp keeps the routers (ffn_gate_inp*) in F32.
        dense = data.ndim < 2 or "ffn_gate_inp" in gname
        type_name = (tensor_types or {}).get(gname, "F32" if dense else tensor_type)
        qtype = GGMLQuantizationType[type_name]
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(gname, data)
            continue
        try:
            if qtype in kquant_types:  # gguf cannot quantize them: kvserve's reference writer
                raw = quantize_kquant(data, qtype)
            else:
                raw = gguf_quants.quantize(data, qtype)
        except NotImplementedError:
            byte_shape = gguf_quants.quant_shape_to_byte_shape(data.shape, qtype)
            raw = rng.integers(0, 256, size=byte_shape, dtype=np.uint8)
        if raw.dtype == np.uint8:  # block-quantised bytes: GGUFWriter derives the shape
            writer.add_tensor(gname, raw, raw_dtype=qtype)
        else:  # F16 comes back as a float16 array
            writer.add_tensor(gname, raw)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
