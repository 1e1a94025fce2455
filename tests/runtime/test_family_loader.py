"""HF directories of the families beyond Llama / Mistral / Qwen2 (Qwen3, Phi-3) and RoPE
scaling configs: the loaded weights are transformers' own, and bad input names what is wrong."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvserve.models import ModelFileNotFoundError, ModelLoadError, load_model
from kvserve.models.hf_loader import SUPPORTED_HF_ARCHS, hf_arch_config
from kvserve.models.weights import split_fused
from tests.tiny_models import edit_config, make_tiny_model

SMALL = {"vocab_size": 256}
LONGROPE = {
    "type": "su",
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [2.0 + 0.1 * i for i in range(8)],
}


def _hf_state_dict(model_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return ref.state_dict()


@pytest.mark.parametrize(
    ("family", "save"),
    [
        ("qwen3", {}),
        ("qwen3", {"max_shard_size": "100KB", "dtype": "bfloat16"}),
        ("phi3", {"max_shard_size": "100KB"}),
        ("phi3", {"dtype": "float16"}),
    ],
)
def test_weights_are_transformers_weights(tmp_path: Path, family: str, save: dict) -> None:
    model_dir = make_tiny_model(tmp_path, family, tokenizer=False, **SMALL, **save)
    if "max_shard_size" in save:
        shards = [n for n in os.listdir(model_dir) if n.endswith(".safetensors")]
        assert len(shards) > 1
    loaded = load_model(model_dir)
    arch = loaded.arch
    want = split_fused(_hf_state_dict(model_dir), arch)  # Phi-3: q/k/v, gate/up rows
    assert sorted(loaded.state_dict) == sorted(want)
    for name, tensor in loaded.state_dict.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, want[name]), name
    assert arch.architecture == family
    assert arch.qk_norm == (family == "qwen3") and not arch.attention_bias
    assert ("model.layers.1.self_attn.k_norm.weight" in want) == arch.qk_norm
    assert "model.layers.0.mlp.up_proj.weight" in loaded.state_dict


def test_phi3_split_takes_the_fused_rows_in_order(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "phi3", tokenizer=False, **SMALL)
    fused = _hf_state_dict(model_dir)
    loaded = load_model(model_dir).state_dict
    p = "model.layers.1."
    qkv = torch.cat([loaded[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(qkv, fused[p + "self_attn.qkv_proj.weight"])
    gate_up = torch.cat([loaded[p + "mlp.gate_proj.weight"], loaded[p + "mlp.up_proj.weight"]])
    assert torch.equal(gate_up, fused[p + "mlp.gate_up_proj.weight"])


def test_rope_configs_as_checkpoints_write_them(tmp_path: Path) -> None:
    """transformers 5's ``rope_parameters`` and 4's ``rope_scaling`` give the same dict;
    Phi-3's top-level original length wins, as in transformers."""
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    # NOTE: a copy: transformers writes rope_theta into the dict it is given.
    model_dir = make_tiny_model(
        tmp_path, "llama", tokenizer=False, rope_scaling=dict(llama3), **SMALL
    )
    assert load_model(model_dir).arch.rope_scaling == llama3  # saved as rope_parameters
    classic = {"architectures": ["LlamaForCausalLM"], "rope_theta": 5e5, "rope_scaling": llama3}
    shapes = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1}
    config = {**classic, **shapes, "num_attention_heads": 2, "max_position_embeddings": 99}
    arch = hf_arch_config(config, "config.json")
    assert arch.rope_scaling == llama3 and arch.rope_theta == 5e5
    phi3 = make_tiny_model(
        tmp_path,
        "phi3",
        tokenizer=False,
        rope_scaling=dict(LONGROPE),
        original_max_position_embeddings=256,
        sliding_window=100,
        **SMALL,
    )
    arch = load_model(phi3).arch
    assert arch.rope_scaling["rope_type"] == "longrope"
    assert arch.rope_scaling["original_max_position_embeddings"] == 256
    assert arch.rope_scaling["short_factor"] == LONGROPE["short_factor"]
    assert arch.sliding_window == 100
    edit_config(phi3, sliding_window=262144)  # Phi-3-mini-128k's: wider than the context
    assert load_model(phi3).arch.sliding_window is None


def test_unknown_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "qwen3", tokenizer=False, **SMALL)
    edit_config(model_dir, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'") as e:
        load_model(model_dir)
    for name in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM"):
        assert name in str(e.value) and name in SUPPORTED_HF_ARCHS


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rope_scaling": {"rope_type": "mrope", "factor": 2}}, r"rope_scaling type 'mrope'"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, None),  # filled from the config
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"lacks 'low_freq_factor'"),
        ({"partial_rotary_factor": 0.75}, r"partial rotary embeddings"),
        ({"attention_bias": True}, r"attention_bias / mlp_bias on qwen3"),
    ],
)
def test_bad_config_is_a_value_error_naming_it(
    tmp_path: Path, changes: dict, message: str | None
) -> None:
    model_dir = make_tiny_model(tmp_path, "qwen3", tokenizer=False, **SMALL)
    edit_config(model_dir, rope_parameters=None, **changes)
    if message is None:
        scaling = load_model(model_dir).arch.rope_scaling
        assert scaling["original_max_position_embeddings"] == 1024  # max_position_embeddings
        return
    with pytest.raises(ValueError, match=rf"config\.json: .*{message}"):
        load_model(model_dir)


def test_phi3_shape_mismatch_names_the_tensor_and_the_file(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "phi3", tokenizer=False, **SMALL)
    edit_config(model_dir, num_key_value_heads=4)
    with pytest.raises(
        ModelLoadError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.qkv_proj\.weight' "
        r"has shape \[128, 64\], but the config implies \[192, 64\]",
    ):
        load_model(model_dir)


def test_missing_shard_is_a_value_error_naming_the_file(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "qwen3", tokenizer=False, max_shard_size="100KB", **SMALL)
    shard = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))[-1]
    os.remove(os.path.join(model_dir, shard))
    with pytest.raises(ModelFileNotFoundError, match=rf"names shard .*{shard}, which is missing"):
        load_model(model_dir)
    assert issubclass(ModelFileNotFoundError, ValueError)
