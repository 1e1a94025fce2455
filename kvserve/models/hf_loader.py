"""HuggingFace model directories (config.json + *.safetensors) -> ModelArchConfig + state dict."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kvserve.config import ModelArchConfig
from kvserve.core.kv.kv_groups import check_layer_types
from kvserve.models.errors import ModelFileNotFoundError, ModelLoadError
from kvserve.models.gemma_config import GEMMA_ARCHS, gemma_hf_fields
from kvserve.models.moe_weights import (
    canonical_name,
    check_stacked,
    hf_moe_fields,
    is_stacked,
    unstack_experts,
)
from kvserve.models.rope import check_rope_scaling, rope_type
from kvserve.models.weights import (
    check_complete,
    check_heads,
    check_shape,
    expected_shapes,
    positive_int,
    split_fused,
)

# HF `architectures[0]` -> our architecture name (SmolLM checkpoints are LlamaForCausalLM;
# Qwen2.5 ones Qwen2ForCausalLM).
SUPPORTED_HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",  # the text model (Gemma3TextConfig)
}
_MODEL_TYPES = {name: name for name in SUPPORTED_HF_ARCHS.values()} | {
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "gemma3_text": "gemma3",
}
# RoPE types whose pretraining context transformers takes from `original_max_position_embeddings`.
_ORIGINAL_LEN_TYPES = ("llama3", "yarn", "longrope")
# Tensors some checkpoints carry that the model recomputes: skipped, never an error.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(model_dir: str) -> dict[str, Any]:
    """Parse ``model_dir/config.json``; raises ModelLoadError naming the file when it is bad."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelFileNotFoundError(f"{model_dir}: no config.json in the model directory")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return config


def hf_arch_config(config: dict[str, Any], path: str) -> ModelArchConfig:
    """Map an HF config.json (Llama / Mistral / Qwen2 / Qwen3 / Phi-3 / SmolLM) to
    ModelArchConfig; ModelLoadError (a ValueError) naming the file and the problem."""
    archs = config.get("architectures") or []
    if archs:
        if archs[0] not in SUPPORTED_HF_ARCHS:
            raise ModelLoadError(
                f"{path}: unsupported architecture {archs[0]!r} "
                f"(supported: {', '.join(sorted(SUPPORTED_HF_ARCHS))})"
            )
        arch = SUPPORTED_HF_ARCHS[archs[0]]
    elif config.get("model_type") in _MODEL_TYPES:
        arch = _MODEL_TYPES[config["model_type"]]
    else:
        raise ModelLoadError(
            f"{path}: unsupported model_type {config.get('model_type')!r} and no architectures "
            f"(supported: {', '.join(sorted(SUPPORTED_HF_ARCHS))})"
        )
    if arch not in GEMMA_ARCHS and config.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: hidden_act {config['hidden_act']!r} is not supported")
    if arch not in ("qwen2", "qwen2moe") and (
        config.get("attention_bias") or config.get("mlp_bias")
    ):
        raise ModelLoadError(f"{path}: attention_bias / mlp_bias on {arch} is not supported")

    def req(key: str) -> int:
        if config.get(key) is None:
            raise ModelLoadError(f"{path}: required key {key!r} is missing")
        return positive_int(config[key], key, path)

    def opt(key: str, default: int) -> int:
        return default if config.get(key) is None else positive_int(config[key], key, path)

    hidden, num_heads = req("hidden_size"), req("num_attention_heads")
    num_kv_heads = opt("num_key_value_heads", num_heads)
    check_heads(num_heads, num_kv_heads, "num_key_value_heads", path)
    head_dim = opt("head_dim", hidden // num_heads)
    extra: dict[str, Any] = {}
    rope_config = config
    if arch in GEMMA_ARCHS:
        extra, rope_config = gemma_hf_fields(config, arch, req("num_hidden_layers"), path)
    rope_params = rope_config.get("rope_parameters") or {}
    rope_theta = rope_config.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    rope_scaling = _rope_scaling(rope_config, arch, head_dim, path)
    sliding = _sliding_window(config, arch, path)
    if sliding is not None and sliding >= int(config.get("max_position_embeddings") or 0) > 0:
        sliding = None  # NOTE: a window past the context (Phi-3-128k's 262144) never slides
    fields: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=req("vocab_size"),
        hidden_size=hidden,
        intermediate_size=req("intermediate_size"),
        num_hidden_layers=req("num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=req("max_position_embeddings"),
        rms_norm_eps=float(
            config.get(
                "rms_norm_eps", 1e-6 if arch.startswith("qwen") or arch in GEMMA_ARCHS else 1e-5
            )
        ),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        tie_word_embeddings=_flag(config, "tie_word_embeddings", path),
        # NOTE: Qwen2-MoE names its q/k/v bias flag qkv_bias (on unless false).
        attention_bias=arch == "qwen2" or (arch == "qwen2moe" and config.get("qkv_bias", True)),
        qk_norm=arch in ("qwen3", "qwen3moe"),
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=_first_int(config.get("bos_token_id")),
        # NOTE: Llama-3 style configs list several eos ids; the first is the primary one.
        eos_token_id=_first_int(config.get("eos_token_id")),
        **hf_moe_fields(config, arch, path),
        layer_types=_mixed_layer_types(config, arch, sliding, path),
    )
    try:
        return ModelArchConfig(**(fields | extra))
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e


def _rope_scaling(
    config: dict[str, Any], arch: str, head_dim: int, path: str
) -> dict[str, Any] | None:
    """The config's RoPE scaling as one dict (``rope_type`` and its parameters), or None.

    Reads ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5); fills
    ``original_max_position_embeddings`` as transformers does (Phi-3 keeps it at the top
    level). ModelLoadError naming an unsupported type, a missing key or partial rotary.
    """
    params = config.get("rope_parameters") or {}
    partial = config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ModelLoadError(
            f"{path}: partial rotary embeddings (partial_rotary_factor {partial}) are not supported"
        )
    scaling = config.get("rope_scaling") or params
    kind = rope_type(scaling)
    if arch == "phi3" and kind == "yarn":
        kind = "longrope"  # NOTE: transformers' Phi3Config reads "yarn" as LongRoPE too
    if kind == "default":
        return None
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
    out["rope_type"] = kind
    if kind in _ORIGINAL_LEN_TYPES:
        original = config.get("original_max_position_embeddings")
        if original is not None:
            out["original_max_position_embeddings"] = original
        out.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    try:
        check_rope_scaling(out, head_dim)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    return out


def _flag(config: dict[str, Any], key: str, path: str) -> bool:
    """A true/false entry of config.json (absent or null: false); ModelLoadError naming the
    key otherwise (``bool("false")`` is true)."""
    value = config.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ModelLoadError(f"{path}: {key!r} must be true or false, got {value!r}")
    return value


def _default_rms_norm_eps(arch: str) -> float:
    """transformers' default ``rms_norm_eps`` of the family's config class."""
    return 1e-6 if arch.startswith("qwen") or arch in GEMMA_ARCHS else 1e-5


def _sliding_window(config: dict[str, Any], arch: str, path: str) -> int | None:
    """The attention window, or None; every layer must use the same kind of attention."""
    window = config.get("sliding_window")
    if arch in ("llama", *GEMMA_ARCHS) or not window:
        return None  # Gemma's: gemma_config.py
    if arch in ("mistral", "phi3", "mixtral"):
        return int(window)
    # NOTE: Qwen2 / Qwen3 configs carry sliding_window but leave it off unless
    # use_sliding_window, and then only layers >= max_window_layers slide (spelled out in
    # layer_types by transformers 5).
    if not config.get("use_sliding_window", False):
        return None
    num_layers = int(config.get("num_hidden_layers", 0))
    layer_types = config.get("layer_types") or [
        "sliding_attention" if i >= config.get("max_window_layers", 0) else "full_attention"
        for i in range(num_layers)
    ]
    if all(t == "full_attention" for t in layer_types):
        return None
    return int(window)  # all sliding, or a mix (``_mixed_layer_types`` says which)


def _mixed_layer_types(
    config: dict[str, Any], arch: str, window: int | None, path: str
) -> tuple[str, ...] | None:
    """Qwen2 / Qwen3 layers that mix sliding and full attention (``layer_types``, else
    ``max_window_layers``), as HF spells them; None when every layer is alike."""
    if window is None or arch not in ("qwen2", "qwen3"):
        return None
    num_layers = int(config.get("num_hidden_layers", 0))
    types = tuple(
        config.get("layer_types")
        or [
            "sliding_attention" if i >= config.get("max_window_layers", 0) else "full_attention"
            for i in range(num_layers)
        ]
    )
    try:
        check_layer_types(types, num_layers, window)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    return types if len(set(types)) > 1 else None


def _first_int(value: Any) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return None if value is None else int(value)


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files of ``model_dir``: those named by the sharded index, else *.safetensors."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index_path}: corrupt safetensors index: {e!r}") from e
        files = [os.path.join(model_dir, n) for n in names]
        for file in files:
            if not os.path.isfile(file):
                raise ModelFileNotFoundError(f"{index_path}: names shard {file}, which is missing")
        return files
    files = sorted(
        os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors")
    )
    if not files:
        raise ModelFileNotFoundError(
            f"{model_dir}: no *.safetensors weights (only safetensors checkpoints are supported)"
        )
    return files


def load_hf_dir(
    model_dir: str, dtype: torch.dtype
) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """Read an HF directory: config.json and every safetensors shard (those the sharded
    index names, when there is one), cast to ``dtype``; fused Phi-3 tensors split."""
    arch = hf_arch_config(read_hf_config(model_dir), os.path.join(model_dir, "config.json"))
    expected = expected_shapes(arch)
    state_dict: dict[str, torch.Tensor] = {}
    for file in safetensors_files(model_dir):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and arch.tie_word_embeddings:
                        continue  # NOTE: tied: the model reuses the embedding, as HF does.
                    target = canonical_name(name)
                    shape = tuple(f.get_slice(name).get_shape())
                    if is_stacked(target):  # [E, ...]: one tensor per expert (views)
                        check_stacked(target, shape, arch, file, label=repr(name))
                        experts = list(f.get_tensor(name).to(dtype).unbind(0))
                        state_dict.update(unstack_experts(target, experts, arch))
                        continue
                    check_shape(target, shape, expected, file, label=repr(name))
                    state_dict[target] = f.get_tensor(name).to(dtype)
        except (SafetensorError, OSError) as e:
            if isinstance(e, FileNotFoundError):
                raise ModelFileNotFoundError(f"{file}: missing") from e
            raise ModelLoadError(f"{file}: corrupt or truncated safetensors file: {e}") from e
    check_complete(state_dict, expected, model_dir)
    return arch, split_fused(state_dict, arch)
