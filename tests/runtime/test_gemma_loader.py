"""Gemma 2 / Gemma 3 (text) checkpoints: the HF loader's config reading and errors, and the
``gemma2`` / ``gemma3`` GGUF files llama.cpp's converter writes (norms stored as ``w + 1``,
its tensor names) against their HF twins and transformers' own GGUF reader."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.models import ModelLoadError, load_model
from kvserve.models.gemma_config import gemma_gguf_fields
from kvserve.models.llama import LlamaForCausalLM
from kvserve.runtime.attention.metadata import SeqSpec, build_attention_metadata
from tests.tiny_gguf import make_tiny_gguf
from tests.tiny_models import edit_config, make_tiny_model

SMALL = {"vocab_size": 256, "num_hidden_layers": 3}
# What llama.cpp's converter writes as is: an attention scale of head_dim's, Gemma 3's
# local RoPE base at 10000 (llama.cpp's fixed value).
AS_CONVERTED = {"query_pre_attn_scalar": 16}
# Gemma 3 as llama.cpp lays it out: five sliding layers, then a full one.
GEMMA3_CONVERTED = {
    **AS_CONVERTED,
    "rope_local_base_freq": 10000.0,
    "num_hidden_layers": 6,
    "sliding_window_pattern": 6,
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": ("gemma2", AS_CONVERTED),
    "gemma3": ("gemma3", GEMMA3_CONVERTED),
    "gemma3-linear": (
        "gemma3",
        {**GEMMA3_CONVERTED, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    ),
    # Not what the converter writes: keys the loader reads where present (an attention
    # scale, the sliding layers' RoPE base, a pattern period other than 6).
    "gemma2-scale": ("gemma2", {"query_pre_attn_scalar": 24}),
    "gemma3-local-base-period": ("gemma3", {"rope_local_base_freq": 100.0}),
    # Every layer sliding (pattern 6 over 2 layers), then no window inside the context: the
    # sliding layers' RoPE base applies all the same.
    "gemma3-all-sliding": (
        "gemma3",
        {"num_hidden_layers": 2, "sliding_window_pattern": 6, "rope_local_base_freq": 100.0},
    ),
    "gemma3-no-window": ("gemma3", {"sliding_window": 4096, "rope_local_base_freq": 100.0}),
}


def _copy(overrides: dict[str, Any]) -> dict[str, Any]:
    # NOTE: transformers writes into the rope dict it is given.
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in overrides.items()}


def _model(loaded: Any) -> LlamaForCausalLM:
    model = LlamaForCausalLM(loaded.arch, attn_backend="torch_sdpa", native_ops=False)
    model.load_weights(loaded.state_dict)
    return model


def _logits(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """One prefill of ``ids`` through a fresh paged cache (blocks of 4): logits [T, vocab]."""
    arch, n = model.arch, ids.shape[0]
    blocks = -(-n // 4)
    shape = (2, blocks, 4, arch.num_key_value_heads, arch.head_dim)
    caches = [torch.zeros(shape) for _ in range(arch.num_hidden_layers)]
    meta = build_attention_metadata(
        [SeqSpec(0, n, 0, list(range(blocks)))],
        block_size=4,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(n), caches, meta))


@pytest.mark.parametrize("case", list(CASES))
def test_f32_gguf_matches_its_hf_twin(tmp_path: Path, case: str) -> None:
    """Same architecture (up to float32 metadata), the same parameters bit for bit in the
    model (the norms' 1 + w included), and the same logits as transformers' HF model."""
    from transformers import AutoModelForCausalLM

    family, overrides = CASES[case]
    kw = {**SMALL, **_copy(overrides)}
    hf_dir = make_tiny_model(tmp_path, family, tokenizer=False, **kw)
    gguf = make_tiny_gguf(tmp_path, family, tensor_type="F32", **_copy(kw))
    twin, ours = load_model(hf_dir), load_model(gguf)
    assert ours.arch.architecture == family and ours.arch.layer_types is not None
    assert (ours.arch.local_rope_theta is not None) == (family == "gemma3")
    # NOTE: GGUF stores the epsilon, and the attention scale where written, as float32.
    assert ours.arch.rms_norm_eps == pytest.approx(twin.arch.rms_norm_eps, rel=1e-6)
    assert ours.arch.query_pre_attn_scalar == pytest.approx(
        twin.arch.query_pre_attn_scalar, rel=1e-6
    )
    same = {f: getattr(twin.arch, f) for f in ("rms_norm_eps", "query_pre_attn_scalar")}
    assert replace(ours.arch, **same) == twin.arch
    assert ours.arch.rope_scaling == twin.arch.rope_scaling
    a, b = _model(ours), _model(twin)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    ids = torch.randint(0, 256, (19,), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
    assert torch.allclose(_logits(a, ids), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_transformers_reads_the_same_gguf_weights(tmp_path: Path, family: str) -> None:
    """transformers' GGUF loader (which also takes the converter's 1 off the norms) reads
    our test files as we do: they are what llama.cpp writes."""
    from transformers import AutoModelForCausalLM

    kw = {**SMALL, **(GEMMA3_CONVERTED if family == "gemma3" else AS_CONVERTED)}
    path = make_tiny_gguf(tmp_path, family, tensor_type="F16", **kw)
    ours = load_model(path)
    ref = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    theirs = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    assert sorted(ours.state_dict) == sorted(theirs)
    for name, tensor in ours.state_dict.items():
        assert torch.equal(tensor, theirs[name]), name


def test_quantized_gemma_gguf_runs_its_embedding_scaled(tmp_path: Path) -> None:
    """Q8_0 kept as blocks (the embedding looked up from them, then scaled): the logits stay
    near the dense model's."""
    path = make_tiny_gguf(tmp_path, "gemma2", tensor_type="Q8_0", **SMALL, **AS_CONVERTED)
    dense, kept = load_model(path), load_model(path, quantization="auto")
    assert "model.embed_tokens.weight" in kept.state_dict
    ids = torch.arange(3, 40, 2)
    want = _logits(_model(dense), ids)
    got = _logits(_model(kept), ids)
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()


def test_gguf_scale_and_pattern_as_llama_cpp_derives_them() -> None:
    """No ``attention.scale``: the 27B shapes (46 / 62 layers) scale by hidden / heads, the
    others by head_dim; a stored scale wins; a pattern period replaces the default."""
    md: dict[str, Any] = {"attention.sliding_window": 4096}

    def fields(arch: str, layers: int, **more: Any) -> dict[str, Any]:
        return gemma_gguf_fields({**md, **more}.get, arch, layers, (4608, 32, 128, 8192), "f")

    assert fields("gemma2", 46)["query_pre_attn_scalar"] == 144.0
    assert fields("gemma2", 42)["query_pre_attn_scalar"] == 128.0
    assert fields("gemma3", 62)["query_pre_attn_scalar"] == 144.0
    scaled = fields("gemma2", 42, **{"attention.scale": 0.0625})
    assert scaled["query_pre_attn_scalar"] == 256.0
    g3 = fields("gemma3", 12)
    assert g3["layer_types"].count("full_attention") == 2 and g3["local_rope_theta"] == 10000.0
    assert fields("gemma3", 12, **{"attention.sliding_window_pattern": 3})["layer_types"][:3] == (
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    )
    no_window = fields("gemma2", 4, **{"attention.sliding_window": 8192})
    assert no_window["sliding_window"] is None and no_window["layer_types"][:2] == (
        "sliding_attention",
        "full_attention",
    )


def test_gguf_pattern_array_is_an_error_naming_the_key(tmp_path: Path) -> None:
    path = make_tiny_gguf(
        tmp_path,
        "gemma3",
        tensor_type="F32",
        metadata={"gemma3.attention.sliding_window_pattern": "x"},
        **SMALL,
    )
    with pytest.raises(ModelLoadError, match=r"sliding_window_pattern.*integer") as e:
        load_model(path)
    assert path in str(e.value)


def test_transformers4_style_config_reads_the_same(tmp_path: Path) -> None:
    """A hub-style Gemma 3 config (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern; no layer_types, no tie key) gives the same architecture as the
    transformers 5 config it saves."""
    hf_dir = make_tiny_model(
        tmp_path,
        "gemma3",
        tokenizer=False,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        **SMALL,
    )
    want = load_model(hf_dir).arch
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    for key in ("rope_parameters", "layer_types", "tie_word_embeddings", "_sliding_window_pattern"):
        config.pop(key, None)
    config.update(
        rope_theta=1e6,
        rope_local_base_freq=100.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        sliding_window_pattern=2,
    )
    with open(path, "w") as f:
        json.dump(config, f)
    got = load_model(hf_dir).arch
    assert got == replace(want, rope_theta=1e6)
    assert got.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert got.local_rope_theta == 100.0 and got.rope_scaling == want.rope_scaling


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_activation": "relu"}, r"hidden_activation 'relu' is not supported"),
        ({"use_bidirectional_attention": True}, r"'use_bidirectional_attention' true"),
        ({"layer_types": ["full_attention"]}, r"'layer_types' must list one type for each"),
        (
            {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
            r"'layer_types' has unsupported type\(s\) \['chunked_attention'\]",
        ),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                }
            },
            r"'rope_parameters.sliding_attention' of rope_type 'linear'",
        ),
        ({"attn_logit_softcapping": -1.0}, r"'attn_logit_softcapping' must be a positive"),
        ({"query_pre_attn_scalar": "big"}, r"'query_pre_attn_scalar' must be a positive"),
        (
            {"architectures": ["Gemma3ForConditionalGeneration"]},
            r"unsupported architecture 'Gemma3ForConditionalGeneration' \(supported: .*"
            r"Gemma3ForCausalLM",
        ),
    ],
)
def test_bad_gemma_config_names_file_and_key(
    tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    hf_dir = make_tiny_model(tmp_path, "gemma3", tokenizer=False, **SMALL)
    edit_config(hf_dir, **changes)
    with pytest.raises(ModelLoadError, match=message) as e:
        load_model(hf_dir)
    assert os.path.join(hf_dir, "config.json") in str(e.value)


def test_gemma2_defaults_when_keys_are_left_out(tmp_path: Path) -> None:
    """A config without the Gemma keys takes transformers' Gemma2Config defaults: soft caps
    50 / 30, scale 256 ** -0.5, window 4096 over every other layer, tied embeddings."""
    hf_dir = make_tiny_model(tmp_path, "gemma2", tokenizer=False, **SMALL)
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    for key in (
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "query_pre_attn_scalar",
        "sliding_window",
        "layer_types",
        "tie_word_embeddings",
        "hidden_activation",
    ):
        config.pop(key, None)
    config["max_position_embeddings"] = 8192
    with open(path, "w") as f:
        json.dump(config, f)
    arch = load_model(hf_dir).arch
    assert (arch.attn_logit_softcapping, arch.final_logit_softcapping) == (50.0, 30.0)
    assert arch.query_pre_attn_scalar == 256.0 and arch.sliding_window == 4096
    assert arch.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert arch.tie_word_embeddings and arch.hidden_act == "gelu_pytorch_tanh"


@pytest.mark.parametrize("case", ["gemma2-scale", "gemma3-linear"])
def test_exported_gemma_loads_in_transformers(tmp_path: Path, case: str) -> None:
    """``write_hf_dir`` (what ``export_hf_dir`` writes from a GGUF): transformers computes
    the same logits from it as the HF twin, and our HF loader reads back the same model."""
    from transformers import AutoModelForCausalLM

    from kvserve.models.export import write_hf_dir

    family, overrides = CASES[case]
    kw = {**SMALL, **_copy(overrides)}
    hf_dir = make_tiny_model(tmp_path, family, tokenizer=False, **kw)
    loaded = load_model(make_tiny_gguf(tmp_path, family, tensor_type="F32", **_copy(kw)))
    out = str(tmp_path / "exported")
    write_hf_dir(loaded.arch, loaded.state_dict, out, pad_token_id=0)
    again = load_model(out)
    assert again.arch == loaded.arch
    ids = torch.arange(5, 60, 3)
    with torch.inference_mode():
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids[None]).logits
        want = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(ids[None]).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
