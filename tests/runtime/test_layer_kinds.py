"""Per-layer attention (Gemma): the attention scale and soft cap in every CPU backend, and
the step's metadata as each kind of layer reads it (``runtime/attention/layer_kinds.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.config import ModelArchConfig
from kvserve.runtime.attention.layer_kinds import kind_metadata, layer_metadata, reads_step_metadata
from kvserve.runtime.attention.metadata import build_attention_metadata
from kvserve.runtime.attention.native_cpu import NativeCPUBackend
from kvserve.runtime.attention.sdpa import TorchSDPABackend
from kvserve.runtime.attention.torch_ref import TorchReferenceBackend
from tests.runtime.test_attention import BLOCK_SIZE, CPU, MIXES, _case

SCALE, CAP = 0.3, 2.0


def _dense(
    q: torch.Tensor,  # [n, H, d] at positions start..
    keys: torch.Tensor,  # [L, kvh, d]
    values: torch.Tensor,
    start: int,
    window: int | None,
    cap: float | None,
) -> torch.Tensor:
    """Causal attention with scale ``SCALE`` and scores soft-capped at ``cap`` (transformers'
    Gemma order: scale, cap, mask, softmax)."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * SCALE
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    k_pos = torch.arange(keys.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


@pytest.mark.parametrize("cap", [None, CAP])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("mix", MIXES)
def test_backends_apply_scale_and_soft_cap(
    mix: list[tuple[int, int]], window: int | None, cap: float | None
) -> None:
    """Every CPU backend (the native kernels take the scale; a soft cap routes them to the
    SDPA path, which applies it) equals dense attention with the layer's scale and cap."""
    data, seqs, cache0 = _case(mix, seed=7 + len(mix))
    step = build_attention_metadata(
        seqs, block_size=BLOCK_SIZE, device=CPU, dtype=torch.float32, sliding_window=window
    )
    meta = kind_metadata(step, window, SCALE, cap)
    assert (meta.scale, meta.logit_softcap) == (SCALE, cap) and step.scale is None
    rows = [slice(s.token_offset, s.token_offset + s.num_query_tokens) for s in seqs]
    expected = torch.cat(
        [
            _dense(data["q"][r], kv[0], kv[1], s.start_pos, window, cap)
            for r, s, kv in zip(rows, seqs, data["full"], strict=True)
        ]
    )
    for name, backend in [
        ("torch_ref", TorchReferenceBackend()),
        ("torch_sdpa", TorchSDPABackend()),
        ("native", NativeCPUBackend()),
        ("native_chunks_all", NativeCPUBackend(chunk_kernel_max_tokens=10**6)),
    ]:
        out = backend.forward(data["q"], data["k"], data["v"], cache0.clone(), meta)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0, msg=name)


def test_kind_metadata_derives_only_what_differs() -> None:
    _, seqs, _ = _case([(7, 6), (4, 1), (0, 13)], seed=3)

    def step(window: int | None, sinks: int = 0):  # noqa: ANN202
        return build_attention_metadata(
            seqs,
            block_size=BLOCK_SIZE,
            device=CPU,
            dtype=torch.float32,
            sliding_window=window,
            num_sink_tokens=sinks,
        )

    plain = step(None)
    assert kind_metadata(plain, None, None, None) is plain  # a full layer, nothing of its own
    narrow = kind_metadata(plain, 5, None, None)  # a sliding layer
    assert narrow is not plain and narrow.sliding_window == 5
    assert torch.equal(narrow.slot_mapping, plain.slot_mapping)
    windowed = step(16, sinks=2)  # the KV cache's own window with sinks (StreamingLLM)
    assert kind_metadata(windowed, 32, None, None) is windowed  # the cache's is tighter
    tighter = kind_metadata(windowed, 5, None, None)
    assert (tighter.sliding_window, tighter.num_sink_tokens) == (5, 0)
    scaled = kind_metadata(plain, None, 0.25, 3.0)
    assert scaled.chunks is plain.chunks and scaled.backend_plans is not plain.backend_plans
    metas = layer_metadata(plain, [5, None, 5, 5, None], 0.25, None)
    assert metas[0] is metas[2] is metas[3] and metas[1] is metas[4]
    assert metas[0].sliding_window == 5 and metas[1].sliding_window is None
    assert all(m.scale == 0.25 for m in metas)


def _arch(**kw: object) -> ModelArchConfig:
    base = dict(
        architecture="gemma3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    return ModelArchConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_arch_windows_per_layer_and_what_a_uniform_cache_may_rely_on() -> None:
    hybrid = _arch(
        sliding_window=8,
        layer_types=("sliding_attention", "full_attention", "sliding_attention", "full_attention"),
    )
    assert [hybrid.layer_window(i) for i in range(4)] == [8, None, 8, None]
    assert hybrid.shared_window is None and not reads_step_metadata(hybrid)
    assert _arch(sliding_window=8).shared_window == 8 and reads_step_metadata(_arch())
    assert not reads_step_metadata(_arch(attn_logit_softcapping=50.0))
    assert not reads_step_metadata(_arch(query_pre_attn_scalar=24.0))
    assert reads_step_metadata(_arch(query_pre_attn_scalar=8.0))  # head_dim's own scale
    assert _arch(query_pre_attn_scalar=64.0).attention_scale == 0.125
    fewer = hybrid.with_num_layers(3)
    assert fewer.layer_types == hybrid.layer_types[:3]
    assert hybrid.with_num_layers(6).layer_types[4:] == hybrid.layer_types[:2]
    with pytest.raises(ValueError, match="layer_types has 3 entries for 4 layers"):
        _arch(layer_types=("full_attention",) * 3)
    with pytest.raises(ValueError, match=r"unknown type\(s\) \['chunked'\]"):
        _arch(layer_types=("full_attention", "chunked") * 2)
    with pytest.raises(ValueError, match="hidden_act 'relu' is not supported"):
        _arch(hidden_act="relu")
    with pytest.raises(ValueError, match="attn_logit_softcapping must be > 0"):
        _arch(attn_logit_softcapping=0.0)
    assert dataclasses.replace(hybrid, layer_types=None).shared_window == 8


@pytest.mark.parametrize("cap", [None, CAP])
def test_triton_applies_scale_and_routes_soft_cap(cap: float | None) -> None:
    """The Triton kernel (interpreted on CPU) takes the layer's scale; a soft-capped layer
    takes the SDPA path (the kernel has no cap)."""
    pytest.importorskip("triton")
    from kvserve.runtime.attention.triton.backend import TritonBackend

    mix = [(7, 6), (4, 1), (0, 3)]
    data, seqs, cache0 = _case(mix, seed=11)
    step = build_attention_metadata(seqs, block_size=BLOCK_SIZE, device=CPU, dtype=torch.float32)
    meta = kind_metadata(step, 5, SCALE, cap)
    rows = [slice(s.token_offset, s.token_offset + s.num_query_tokens) for s in seqs]
    expected = torch.cat(
        [
            _dense(data["q"][r], kv[0], kv[1], s.start_pos, 5, cap)
            for r, s, kv in zip(rows, seqs, data["full"], strict=True)
        ]
    )
    out = TritonBackend().forward(data["q"], data["k"], data["v"], cache0.clone(), meta)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_tensor_parallel_refuses_gemma() -> None:
    from kvserve.distributed.sharding import validate_tp

    gemma = _arch(scale_embeddings=True, norm_weight_offset=1.0, sandwich_norms=True)
    with pytest.raises(ValueError, match="does not serve gemma3 models yet"):
        validate_tp(gemma, 2)
    validate_tp(gemma, 1)
