"""Write a loaded model as an HF directory (config.json + model.safetensors + tokenizer).

NOTE: transformers refuses ``save_pretrained`` on a GGUF-loaded model and vLLM cannot read
GGUF, so benchmarks feed vLLM (and anything else) the same weights through this export.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

from kvserve.config import ModelArchConfig
from kvserve.models.gemma_config import GEMMA_ARCHS, gemma_hf_config
from kvserve.models.loader import load_model
from kvserve.models.moe_weights import checkpoint_names, hf_moe_config
from kvserve.models.weights import FUSED_CHECKPOINT_ARCHS, join_fused, resolve_dtype

_HF_ARCH_NAMES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}


def hf_config_dict(arch: ModelArchConfig, dtype: torch.dtype) -> dict[str, Any]:
    """An HF config.json for ``arch``, readable by transformers 4.x / 5.x and vLLM.

    NOTE: uses the classic ``rope_theta`` / ``rope_scaling`` keys, which transformers 5 maps
    to ``rope_parameters`` on load, so older readers (vLLM's pinned transformers) work too.
    """
    class_name, model_type = _HF_ARCH_NAMES[arch.architecture]
    if (arch.rope_scaling or {}).get("rope_type") == "freq_factors":
        # NOTE: a GGUF keeps llama3 scaling only as its per-frequency result; the llama3
        # parameters transformers needs cannot be read back from it.
        raise ValueError(
            "cannot write an HF config for RoPE given as per-frequency factors (a GGUF's "
            "'rope_freqs' tensor): transformers needs the llama3 parameters, which the file "
            "does not keep"
        )
    dtype_name = str(dtype).removeprefix("torch.")
    config: dict[str, Any] = {
        "architectures": [class_name],
        "model_type": model_type,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": arch.rope_scaling,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": arch.bos_token_id,
        "eos_token_id": arch.eos_token_id,
        "torch_dtype": dtype_name,
        **hf_moe_config(arch),
    }
    if arch.architecture == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    if arch.architecture != "llama":
        config["sliding_window"] = arch.sliding_window
    if arch.architecture in ("qwen2", "qwen3", "qwen2moe", "qwen3moe"):
        config["use_sliding_window"] = arch.sliding_window is not None
    if arch.architecture in ("qwen3", "qwen3moe"):
        config["attention_bias"] = False
    if arch.architecture in GEMMA_ARCHS:
        config.update(gemma_hf_config(arch))
    original = (arch.rope_scaling or {}).get("original_max_position_embeddings")
    if arch.architecture == "phi3" and original is not None:
        config["original_max_position_embeddings"] = original  # NOTE: Phi-3 keeps it here
    return config


def write_hf_dir(
    arch: ModelArchConfig,
    state_dict: dict[str, torch.Tensor],
    out_dir: str,
    *,
    pad_token_id: int | None = None,
) -> None:
    """Write config.json, generation_config.json and model.safetensors for these weights
    (Phi-3's q/k/v and gate/up fused again, Mixtral's experts named ``w1/w2/w3``, as their
    checkpoints hold them)."""
    os.makedirs(out_dir, exist_ok=True)
    if arch.architecture in FUSED_CHECKPOINT_ARCHS:
        state_dict = join_fused(state_dict)
    state_dict = checkpoint_names(state_dict, arch)
    dtypes = {t.dtype for t in state_dict.values()}
    if len(dtypes) != 1:
        raise ValueError(f"state_dict mixes dtypes {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        config = hf_config_dict(arch, dtype)
        if pad_token_id is not None:
            config["pad_token_id"] = pad_token_id  # NOTE: Phi3Config's default is 32000
        json.dump(config, f, indent=2)
    generation = {"bos_token_id": arch.bos_token_id, "eos_token_id": arch.eos_token_id}
    if pad_token_id is not None:
        generation["pad_token_id"] = pad_token_id
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(generation, f, indent=2)
    tensors = {name: t.contiguous() for name, t in state_dict.items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def export_hf_dir(
    gguf_path: str | None, out_dir: str, dtype: torch.dtype | str = torch.float32
) -> str:
    """Convert a GGUF model (None = the embedded one) into an HF directory; returns ``out_dir``.

    Writes config.json, generation_config.json, model.safetensors (dequantised weights in
    ``dtype``) and the tokenizer files (tokenizer.json, tokenizer_config.json, chat template)
    derived from the GGUF by transformers.
    """
    from transformers import AutoTokenizer  # NOTE: lazy: transformers takes ~2 s to import

    loaded = load_model(gguf_path, resolve_dtype(dtype))
    if loaded.gguf_file is None:
        raise ValueError(f"{loaded.path}: export_hf_dir expects a GGUF file, got an HF directory")
    tokenizer = AutoTokenizer.from_pretrained(loaded.tokenizer_dir, gguf_file=loaded.gguf_file)
    write_hf_dir(loaded.arch, loaded.state_dict, out_dir, pad_token_id=tokenizer.pad_token_id)
    tokenizer.save_pretrained(out_dir)
    return out_dir
