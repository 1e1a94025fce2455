"""Sharding arithmetic: each rank's shapes and slices, replicated KV heads, bad sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.config import ModelArchConfig
from kvserve.distributed.sharding import OVERSUBSCRIBE_ENV, ShardSpec, validate_tp

ARCH = ModelArchConfig(
    architecture="llama",
    vocab_size=10,
    hidden_size=8,
    intermediate_size=12,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=2,
    max_position_embeddings=64,
)


def _state_dict(arch: ModelArchConfig = ARCH) -> dict[str, torch.Tensor]:
    d, h, kvh = arch.head_dim, arch.num_attention_heads, arch.num_key_value_heads
    hid, inter, v = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    p = "model.layers.0."

    def t(*shape: int) -> torch.Tensor:
        return torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).view(shape)

    return {
        "model.embed_tokens.weight": t(v, hid),
        "lm_head.weight": t(v, hid) + 1000,
        "model.norm.weight": t(hid),
        p + "input_layernorm.weight": t(hid),
        p + "post_attention_layernorm.weight": t(hid),
        p + "self_attn.q_proj.weight": t(h * d, hid),
        p + "self_attn.q_proj.bias": t(h * d),
        p + "self_attn.k_proj.weight": t(kvh * d, hid) + 100,
        p + "self_attn.v_proj.weight": t(kvh * d, hid) + 200,
        p + "self_attn.o_proj.weight": t(hid, h * d),
        p + "self_attn.o_proj.bias": t(hid) + 1,
        p + "mlp.gate_proj.weight": t(inter, hid),
        p + "mlp.up_proj.weight": t(inter, hid) + 300,
        p + "mlp.down_proj.weight": t(hid, inter),
    }


@pytest.mark.parametrize(
    ("tp", "heads", "kv_heads", "kv_starts", "inter", "vocab"),
    [
        (1, 4, 2, [0], 12, 10),
        (2, 2, 1, [0, 1], 6, 5),
        (4, 1, 1, [0, 0, 1, 1], 3, 3),  # more ranks than KV heads: replicated
    ],
)
def test_rank_shapes(tp, heads, kv_heads, kv_starts, inter, vocab) -> None:  # noqa: ANN001
    sd = _state_dict()
    p = "model.layers.0."
    for rank in range(tp):
        spec = ShardSpec(ARCH, tp, rank)
        local = spec.local_arch()
        assert (local.num_attention_heads, local.num_key_value_heads) == (heads, kv_heads)
        assert spec.kv_head_start == kv_starts[rank]
        assert (local.intermediate_size, local.vocab_size) == (inter, vocab)
        assert spec.kv_replicated == (tp > ARCH.num_key_value_heads)
        s = spec.shard_state_dict(sd)
        d = ARCH.head_dim
        assert s[p + "self_attn.q_proj.weight"].shape == (heads * d, 8)
        assert s[p + "self_attn.k_proj.weight"].shape == (kv_heads * d, 8)
        assert s[p + "self_attn.o_proj.weight"].shape == (8, heads * d)
        assert s[p + "mlp.gate_proj.weight"].shape == (inter, 8)
        assert s[p + "mlp.down_proj.weight"].shape == (8, inter)
        assert s["model.embed_tokens.weight"].shape == (vocab, 8)
        assert torch.equal(s["model.norm.weight"], sd["model.norm.weight"])
        # the KV head a rank holds is the one its query heads use (GQA group = head // 2)
        first_q_head = spec.head_start
        assert first_q_head // (ARCH.num_attention_heads // ARCH.num_key_value_heads) == (
            spec.kv_head_start
        )


@pytest.mark.parametrize("tp", [2, 4])
def test_slices_reassemble_the_full_weights(tp: int) -> None:
    sd = _state_dict()
    p = "model.layers.0."
    shards = [ShardSpec(ARCH, tp, r).shard_state_dict(sd) for r in range(tp)]

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    for name in ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "mlp.gate_proj.weight"):
        assert torch.equal(cat(p + name, 0), sd[p + name])
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        assert torch.equal(cat(p + name, 1), sd[p + name])
    # row-parallel bias: added once (rank 0), zero elsewhere, so the all-reduce sums it once
    assert torch.equal(
        sum(s[p + "self_attn.o_proj.bias"] for s in shards), sd[p + "self_attn.o_proj.bias"]
    )
    # vocab rows: padded to a multiple of tp with zeros, real rows in order
    emb = cat("model.embed_tokens.weight", 0)
    assert emb.shape[0] == -(-10 // tp) * tp
    assert torch.equal(emb[:10], sd["model.embed_tokens.weight"])
    assert not emb[10:].any()
    k = cat(p + "self_attn.k_proj.weight", 0)
    if tp == 2:
        assert torch.equal(k, sd[p + "self_attn.k_proj.weight"])
    else:  # replicated: ranks 0,1 hold KV head 0, ranks 2,3 KV head 1
        full = sd[p + "self_attn.k_proj.weight"].view(2, 2, 8)
        assert torch.equal(k.view(4, 2, 8), full[[0, 0, 1, 1]])


def test_quantized_sources_are_dequantized() -> None:
    class FakeQuant:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def dequantize(self) -> torch.Tensor:
            return self.t

    sd = _state_dict()
    name = "model.layers.0.mlp.down_proj.weight"
    sd[name] = FakeQuant(sd[name])  # type: ignore[assignment]
    s = ShardSpec(ARCH, 2, 1).shard_state_dict(sd)
    assert torch.equal(s[name], _state_dict()[name][:, 6:])


def test_bad_sizes_are_rejected_naming_the_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OVERSUBSCRIBE_ENV, "1")
    with pytest.raises(
        ValueError, match="tensor_parallel_size 3 does not divide the model's 4 query heads"
    ):
        validate_tp(ARCH, 3)
    odd = dataclasses.replace(
        ARCH, num_attention_heads=6, num_key_value_heads=3, intermediate_size=12
    )
    with pytest.raises(ValueError, match="2 neither divides nor is a multiple of the model's 3 KV"):
        validate_tp(odd, 2)
    with pytest.raises(ValueError, match="does not divide the MLP width 10"):
        validate_tp(dataclasses.replace(ARCH, intermediate_size=10), 4)
    validate_tp(ARCH, 4)
    monkeypatch.delenv(OVERSUBSCRIBE_ENV)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1})
    with pytest.raises(
        ValueError, match="tensor_parallel_size 4 exceeds the 2 CPU cores available"
    ):
        validate_tp(ARCH, 4)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    with pytest.raises(ValueError, match="exceeds the 1 CUDA devices available"):
        validate_tp(ARCH, 2, "cuda")
