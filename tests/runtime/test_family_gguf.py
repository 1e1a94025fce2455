"""GGUF files of the ``qwen3`` and ``phi3`` architectures, as llama.cpp's converter names
them (written here with the ``gguf`` package), against their HF twins: the same weights bit
for bit (F32), the same architecture and RoPE, and transformers' own GGUF reader agrees."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvserve.models import ModelLoadError, load_model
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.quant import QuantizedWeight
from kvserve.models.rope import compute_rope
from kvserve.runtime.attention.metadata import SeqSpec, build_attention_metadata
from kvserve.runtime.kv_cache import KVCache
from tests.runtime.runtime_testutil import hf_logits
from tests.tiny_gguf import make_tiny_gguf
from tests.tiny_models import make_tiny_model

SMALL = {"vocab_size": 256}
LONGROPE = {
    "type": "su",
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [2.0 + 0.3 * i for i in range(8)],
}
CASES = {
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "qwen3-yarn": (
        "qwen3",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        },
    ),
    "phi3": ("phi3", {}),
    "phi3-longrope-window": (
        "phi3",
        {"original_max_position_embeddings": 256, "rope_scaling": LONGROPE, "sliding_window": 64},
    ),
}


def _rope(arch):  # noqa: ANN001, ANN202 - ModelArchConfig -> (inv_freq, scale)
    return compute_rope(
        arch.head_dim,
        arch.rope_theta,
        arch.rope_scaling,
        max_position_embeddings=arch.max_position_embeddings,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_f32_gguf_equals_its_hf_twin(tmp_path: Path, case: str) -> None:
    family, overrides = CASES[case]
    kw = {**SMALL, **{k: (dict(v) if isinstance(v, dict) else v) for k, v in overrides.items()}}
    hf_dir = make_tiny_model(tmp_path, family, tokenizer=False, **kw)
    kw = {**SMALL, **{k: (dict(v) if isinstance(v, dict) else v) for k, v in overrides.items()}}
    gguf = make_tiny_gguf(tmp_path, family, tensor_type="F32", **kw)
    twin, ours = load_model(hf_dir), load_model(gguf)
    # NOTE: GGUF stores the norm epsilon as float32.
    assert ours.arch.rms_norm_eps == pytest.approx(twin.arch.rms_norm_eps, rel=1e-6)
    assert replace(ours.arch, rms_norm_eps=twin.arch.rms_norm_eps) == twin.arch
    assert ours.arch.architecture == family
    assert ours.arch.sliding_window == overrides.get("sliding_window")
    (inv, scale), (twin_inv, twin_scale) = _rope(ours.arch), _rope(twin.arch)
    assert torch.equal(inv, twin_inv) and scale == twin_scale
    assert (scale != 1.0) == ("rope_scaling" in overrides)
    assert sorted(ours.state_dict) == sorted(twin.state_dict)
    for name, tensor in ours.state_dict.items():
        assert torch.equal(tensor, twin.state_dict[name]), name


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_transformers_reads_the_same_weights(tmp_path: Path, family: str) -> None:
    """transformers' GGUF loader on our test files: the files are what llama.cpp writes."""
    from transformers import AutoModelForCausalLM

    from kvserve.models.weights import split_fused

    # NOTE: transformers' GGUF reader takes Qwen3's head_dim from its config default (128),
    # not attention.key_length, and Phi-3's pad id (32000) from the config unless given.
    kw = {"head_dim": 128} if family == "qwen3" else {}
    pad = {"tokenizer.ggml.padding_token_id": 2}
    path = make_tiny_gguf(tmp_path, family, tensor_type="F16", metadata=pad, **kw, **SMALL)
    ours = load_model(path)
    ref = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    theirs = split_fused(ref.state_dict(), ours.arch)
    assert sorted(ours.state_dict) == sorted(theirs)
    for name, tensor in ours.state_dict.items():
        assert torch.equal(tensor, theirs[name]), name


def test_quantized_phi3_splits_whole_rows_of_blocks(tmp_path: Path) -> None:
    path = make_tiny_gguf(tmp_path, "phi3", tensor_type="Q8_0", **SMALL)
    kept = load_model(path, quantization="auto").state_dict
    dense = load_model(path).state_dict
    for name in ("self_attn.k_proj.weight", "mlp.up_proj.weight"):
        part = kept[f"model.layers.1.{name}"]
        assert isinstance(part, QuantizedWeight) and part.qtype == "q8_0"
        assert torch.equal(part.dequantize(), dense[f"model.layers.1.{name}"])


def test_phi3_gguf_missing_rope_factor_is_named(tmp_path: Path) -> None:
    rope = {**LONGROPE, "short_factor": list(LONGROPE["short_factor"])}
    path = make_tiny_gguf(
        tmp_path,
        "phi3",
        original_max_position_embeddings=256,
        rope_scaling=rope,
        drop_tensors=("rope_factors_short.weight",),
        **SMALL,
    )
    with pytest.raises(ModelLoadError, match=r"'rope_factors_short\.weight' is missing"):
        load_model(path)


@pytest.mark.parametrize("case", ["qwen3-tied", "phi3-longrope-window"])
def test_written_hf_dir_loads_in_transformers(tmp_path: Path, case: str) -> None:
    """``write_hf_dir`` (what ``export_hf_dir`` writes from a GGUF): transformers reads back
    the same weights and RoPE, and so does our HF loader."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvserve.models.export import write_hf_dir
    from kvserve.models.weights import split_fused

    family, overrides = CASES[case]
    kw = {**SMALL, **{k: (dict(v) if isinstance(v, dict) else v) for k, v in overrides.items()}}
    loaded = load_model(make_tiny_gguf(tmp_path, family, tensor_type="F32", **kw))
    out = str(tmp_path / "exported")
    write_hf_dir(loaded.arch, loaded.state_dict, out, pad_token_id=2)
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    theirs = split_fused(ref.state_dict(), loaded.arch)
    if loaded.arch.tie_word_embeddings:
        del theirs["lm_head.weight"]
    assert sorted(theirs) == sorted(loaded.state_dict)
    for name, tensor in loaded.state_dict.items():
        assert torch.equal(tensor, theirs[name]), name
    config = ref.config
    kind = config.rope_parameters["rope_type"]
    if kind != "default":
        # NOTE: served at the model's whole context: LongRoPE's long factors on both sides.
        longest = config.max_position_embeddings
        want_inv, want_scale = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=longest)
        inv, scale = _rope(loaded.arch)
        assert torch.equal(inv, want_inv) and scale == pytest.approx(want_scale, rel=1e-12)
    assert config.sliding_window == loaded.arch.sliding_window
    again = load_model(out)
    assert again.arch == loaded.arch
    assert all(torch.equal(t, loaded.state_dict[n]) for n, t in again.state_dict.items())


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_llama3_rope_read_from_rope_freqs_matches_the_hf_twin(tmp_path: Path) -> None:
    """Llama 3.x GGUFs keep llama3 RoPE scaling as a ``rope_freqs`` divisor per frequency
    (llama.cpp's converter): read as such, the frequencies and the logits are the HF twin's
    within fp32 rounding (head_dim 16: one frequency kept, two blended, five divided)."""
    from transformers import AutoModelForCausalLM

    kw = {**SMALL, "initializer_range": 0.1}
    hf_dir = make_tiny_model(
        tmp_path, "llama", tokenizer=False, rope_scaling=dict(LLAMA3_ROPE), **kw
    )
    gguf = make_tiny_gguf(
        tmp_path, "llama", tensor_type="F32", rope_scaling=dict(LLAMA3_ROPE), **kw
    )
    ours, twin = load_model(gguf), load_model(hf_dir)
    assert ours.arch.rope_scaling is not None
    assert ours.arch.rope_scaling["rope_type"] == "freq_factors"
    (inv, scale), (twin_inv, twin_scale) = _rope(ours.arch), _rope(twin.arch)
    assert scale == twin_scale == 1.0
    torch.testing.assert_close(inv, twin_inv, rtol=1e-6, atol=0)
    assert not torch.allclose(inv, compute_rope(16, ours.arch.rope_theta, None)[0])

    prompt = [(7 * i + 3) % 250 for i in range(90)]  # past the low frequencies' wavelength
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    torch.testing.assert_close(_logits(ours, prompt), hf_logits(ref, prompt), atol=1e-4, rtol=0)


def _logits(loaded, token_ids: list[int]) -> torch.Tensor:  # noqa: ANN001 - LoadedModel
    """[len, vocab] logits of one prefill of ``token_ids`` through kvserve's model."""
    arch = loaded.arch
    model = LlamaForCausalLM(arch, attn_backend="torch_sdpa", native_ops=False)
    model.load_weights(loaded.state_dict)
    block_size, n = 16, len(token_ids)
    blocks = -(-n // block_size)
    cache = KVCache(num_layers=arch.num_hidden_layers, num_blocks=blocks, block_size=block_size,
                    num_kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim,
                    dtype=torch.float32)  # fmt: skip
    meta = build_attention_metadata(
        [SeqSpec(0, n, 0, list(range(blocks)))],
        block_size=block_size,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.arange(n), cache.layer_caches, meta)
        return model.compute_logits(hidden).float()


def test_rope_freqs_of_the_wrong_length_or_beside_a_scaling_type_are_named(
    tmp_path: Path,
) -> None:
    kw = {**SMALL, "rope_scaling": dict(LLAMA3_ROPE)}
    linear = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    path = make_tiny_gguf(tmp_path, "llama", metadata=linear, **kw)
    with pytest.raises(ModelLoadError, match=r"both a 'rope_freqs\.weight' tensor and rope"):
        load_model(path)
    head_8 = {"llama.attention.key_length": 8, "llama.rope.dimension_count": 8}
    path = make_tiny_gguf(tmp_path, "llama", metadata=head_8, **kw)
    with pytest.raises(ModelLoadError, match=r"'rope_freqs\.weight' has shape \[8\], but the head"):
        load_model(path)


def test_a_gguf_rope_given_as_factors_is_not_written_as_an_hf_config(tmp_path: Path) -> None:
    from kvserve.models.export import hf_config_dict

    arch = load_model(
        make_tiny_gguf(tmp_path, "llama", rope_scaling=dict(LLAMA3_ROPE), **SMALL)
    ).arch
    with pytest.raises(ValueError, match="per-frequency factors"):
        hf_config_dict(arch, torch.float32)
