"""RoPE variants (``kvserve/models/rope.py``) against transformers' own ``ROPE_INIT_FUNCTIONS``:
the same inverse frequencies bit for bit and the same attention factor, and the errors."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvserve.models.rope import check_rope_scaling, compute_rope, rope_cos_sin

HEAD_DIM = 64
THETA = 500000.0
MAX_POS = 8192


def _hf(rope: dict, seq_len: int | None = None, config_cls=transformers.LlamaConfig, **kw):
    """transformers' (inv_freq, attention factor) for a config with this ``rope_parameters``."""
    config = config_cls(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        max_position_embeddings=MAX_POS,
        rope_parameters={"rope_theta": THETA, **rope},
        **kw,
    )
    rope_type = config.rope_parameters["rope_type"]
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)


STATIC = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "yarn-untruncated": {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
    },
}


@pytest.mark.parametrize("name", list(STATIC))
def test_static_types_equal_transformers(name: str) -> None:
    rope = STATIC[name]
    want_inv, want_scale = _hf(rope)
    got_inv, got_scale = compute_rope(HEAD_DIM, THETA, rope, max_position_embeddings=MAX_POS)
    assert torch.equal(got_inv, want_inv)
    assert got_scale == pytest.approx(want_scale, rel=1e-12)
    assert (got_scale != 1.0) == name.startswith("yarn")


def test_dynamic_is_transformers_at_the_longest_context() -> None:
    """vLLM's fixed NTK base: transformers' at seq_len = factor x max_position_embeddings."""
    rope = {"rope_type": "dynamic", "factor": 2.0}
    want_inv, _ = _hf(rope, seq_len=2 * MAX_POS)
    got_inv, scale = compute_rope(HEAD_DIM, THETA, rope, max_position_embeddings=MAX_POS)
    torch.testing.assert_close(got_inv, want_inv, rtol=1e-6, atol=0)
    assert scale == 1.0
    base_inv, _ = compute_rope(HEAD_DIM, THETA, None)
    assert got_inv[0] == base_inv[0] and torch.all(got_inv[1:] < base_inv[1:])


@pytest.mark.parametrize("served", [4096, 4097])
def test_longrope_factors_follow_the_served_length(served: int) -> None:
    """Short factors while the served context fits the pretraining one, long past it
    (vLLM's rule); transformers picks the same for a sequence of that length."""
    half = HEAD_DIM // 2
    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.01 * i for i in range(half)],
        "long_factor": [1.0 + 0.5 * i for i in range(half)],
    }
    kw = {"original_max_position_embeddings": 4096}
    want_inv, want_scale = _hf(rope, seq_len=served, config_cls=transformers.Phi3Config, **kw)
    ours = {**rope, "original_max_position_embeddings": 4096}
    got_inv, got_scale = compute_rope(
        HEAD_DIM, THETA, ours, max_position_embeddings=MAX_POS, max_model_len=served
    )
    assert torch.equal(got_inv, want_inv)
    assert got_scale == pytest.approx(want_scale) == math.sqrt(1 + math.log(2) / math.log(4096))


def test_scaled_cos_sin_are_transformers_cos_sin() -> None:
    """cos / sin multiplied by the attention factor in fp32, then rounded once."""
    inv, scale = compute_rope(HEAD_DIM, THETA, STATIC["yarn"])
    positions = torch.arange(37)
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = rope_cos_sin(inv, positions, dtype, scale=scale)
        freqs = positions[:, None].float() * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        assert torch.equal(cos[:, 0], (emb.cos() * scale).to(dtype))
        half = HEAD_DIM // 2
        want_sin = (emb.sin() * scale).to(dtype)
        assert torch.equal(sin[:, 0, half:], want_sin[:, half:])
        assert torch.equal(sin[:, 0, :half], -want_sin[:, :half])


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "mrope", "factor": 2.0}, r"unsupported rope_scaling type 'mrope'"),
        ({"type": "ntk-by-parts"}, r"'ntk-by-parts'; supported: default, linear, dynamic"),
        ({"rope_type": "llama3", "factor": 8.0}, r"'llama3' lacks 'low_freq_factor'"),
        ({"rope_type": "yarn", "factor": 4.0}, r"lacks 'original_max_position_embeddings'"),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0],
                "long_factor": [1.0],
                "original_max_position_embeddings": 4,
            },
            r"'short_factor' must list head_dim / 2 = 32 numbers",
        ),
    ],
)
def test_bad_rope_scaling_is_a_value_error_naming_it(rope: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_rope_scaling(rope, HEAD_DIM)
    with pytest.raises(ValueError, match=message):
        compute_rope(HEAD_DIM, THETA, rope, max_position_embeddings=MAX_POS)
