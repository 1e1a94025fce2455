"""Quantized KV cache (int8 / fp8): round-trip bounds, attention, swaps, tiny-model logits;
and windowed attention with sinks against a dense reference with the same mask."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvserve.runtime.attention.metadata import NULL_BLOCK_ID, SeqSpec, build_attention_metadata
from kvserve.runtime.attention.native_cpu import NativeCPUBackend
from kvserve.runtime.attention.sdpa import TorchSDPABackend
from kvserve.runtime.attention.torch_ref import TorchReferenceBackend
from kvserve.runtime.kv_cache import (
    KVCache,
    QuantizedLayerCache,
    dequantize_kv,
    kv_bytes_per_token,
    quantize_kv,
)
from kvserve.runtime.model_runner import ModelRunner
from tests.runtime.runtime_testutil import ToyAllocator, generate, ours_from_hf, tiny_hf_model

CPU = torch.device("cpu")
BS = 4
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 8


def _values(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(50, NUM_KV_HEADS, HEAD_DIM, generator=gen) * 3.0
    x[0] = 0.0  # an all-zero token must survive (no 0/0 in the scale)
    x[1, 0] = 1e-30  # tiny values
    x[2] *= 1e4  # a large-magnitude token
    return x  # [50, kvh, d]


def test_int8_round_trip_error_at_most_half_a_step() -> None:
    x = _values(0)
    q, scale = quantize_kv(x, "int8")
    assert q.dtype == torch.int8 and scale.shape == x.shape[:-1]
    err = (dequantize_kv(q, scale, "int8", torch.float32) - x).abs()
    assert bool((err <= scale.unsqueeze(-1) / 2 * (1 + 1e-6)).all())
    assert torch.equal(dequantize_kv(q[0], scale[0], "int8", torch.float32), x[0])
    # The largest element of every token head is exact up to float rounding.
    amax = x.abs().amax(-1)
    assert torch.allclose(scale * 127, amax.clamp_min(1e-12 * 127), rtol=1e-6)


def test_fp8_round_trip_relative_error_bound() -> None:
    x = _values(1)
    q, scale = quantize_kv(x, "fp8")
    assert q.dtype == torch.uint8
    back = dequantize_kv(q, scale, "fp8", torch.float32)
    err = (back - x).abs()
    s = scale.unsqueeze(-1)
    # e4m3: 3 mantissa bits -> half-ulp relative error 2**-4 for normals; the subnormal
    # step is 2**-9, so below 2**-6 the absolute error is at most 2**-10 (in units of s).
    bound = 2.0**-4 * x.abs() + 2.0**-10 * s
    assert bool((err <= bound * (1 + 1e-6)).all())
    assert torch.equal(back[0], x[0])


def test_quantize_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown kind"):
        quantize_kv(torch.ones(2, 4), "int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVCache(
            num_layers=1,
            num_blocks=2,
            block_size=2,
            num_kv_heads=1,
            head_dim=4,
            kv_cache_dtype="int4",
        )


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_bytes_per_token_include_scales(kind: str) -> None:
    cache = KVCache(
        num_layers=3,
        num_blocks=5,
        block_size=4,
        num_kv_heads=2,
        head_dim=8,
        num_host_blocks=2,
        kv_cache_dtype=kind,
    )
    expected = 2 * 3 * 2 * (8 * 1 + 4)  # 1-byte elements + one float32 scale per head
    assert cache.bytes_per_token == expected
    assert (
        kv_bytes_per_token(
            num_layers=3, num_kv_heads=2, head_dim=8, kv_cache_dtype=kind, dtype=torch.float32
        )
        == expected
    )
    assert isinstance(cache.layer_caches[0], QuantizedLayerCache)
    full = kv_bytes_per_token(
        num_layers=3, num_kv_heads=2, head_dim=8, kv_cache_dtype="auto", dtype=torch.float32
    )
    assert full == 2 * 3 * 2 * 8 * 4


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_swap_and_copy_move_scales(kind: str) -> None:
    cache = KVCache(
        num_layers=2,
        num_blocks=6,
        block_size=BS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        num_host_blocks=3,
        kv_cache_dtype=kind,
    )
    layer = cache.layer_caches[1]
    assert isinstance(layer, QuantizedLayerCache)
    x = _values(2)[: 2 * BS].view(2, BS, NUM_KV_HEADS, HEAD_DIM)
    q, s = quantize_kv(x, kind)
    layer.data[:, 4], layer.scales[:, 4] = q, s
    expected = dequantize_kv(layer.data[:, 4], layer.scales[:, 4], kind, torch.float32)
    cache.copy_blocks([(4, 1)])
    cache.swap_out([(1, 2)])
    layer.data[:, 1].zero_()
    layer.scales[:, 1].zero_()
    cache.swap_in([(2, 5)])
    got = dequantize_kv(layer.data[:, 5], layer.scales[:, 5], kind, torch.float32)
    assert torch.equal(got, expected)
    assert torch.equal(cache.host_scales[1, :, 2], s)


def _dense(q, keys, values, start, window, sinks):
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    k_pos = torch.arange(keys.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= (k_pos > q_pos - window) | (k_pos < sinks)
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, -math.inf).softmax(-1), values)


def _case(shapes, seed, kind, window=None, sinks=0):
    """Sequences (start, n) with random K/V; context prefilled into the (quantized) cache.

    With a window, context blocks no query can see are NULL in the table (freed)."""
    gen = torch.Generator().manual_seed(seed)
    free = list(range(1, 40))
    random.Random(seed).shuffle(free)
    cache = KVCache(
        num_layers=1,
        num_blocks=40,
        block_size=BS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        kv_cache_dtype=kind,
    )
    seqs, full, offset = [], [], 0
    for start, n in shapes:
        total = start + n
        blocks = [free.pop() for _ in range(-(-total // BS))]
        keys = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        values = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        pre = SeqSpec(0, start, 0, blocks) if start else None
        if pre is not None:  # write the context through the reference backend's write path
            meta = build_attention_metadata([pre], block_size=BS, device=CPU, dtype=torch.float32)
            TorchReferenceBackend().forward(
                torch.zeros(start, NUM_HEADS, HEAD_DIM),
                keys[:start],
                values[:start],
                cache.layer_caches[0],
                meta,
            )
        if window is not None:
            for i in range(len(blocks)):
                if i * BS >= sinks and (i + 1) * BS <= start - window + 1:
                    blocks[i] = NULL_BLOCK_ID
        seqs.append(SeqSpec(offset, n, start, blocks))
        full.append((keys, values))
        offset += n
    q = torch.randn(offset, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.cat([kv[0][s.start_pos :] for kv, s in zip(full, seqs, strict=True)])
    v = torch.cat([kv[1][s.start_pos :] for kv, s in zip(full, seqs, strict=True)])
    return q, k, v, full, seqs, cache


MIXES = [
    [(5, 1), (12, 1), (0, 1), (31, 1)],
    [(0, 9), (15, 6), (4, 1)],
    [(3, 1), (9, 1), (0, 13), (6, 10), (17, 1), (22, 8)],
]


def _expected(q, full, seqs, kind, window, sinks):
    outs = []
    for s, (keys, values) in zip(seqs, full, strict=True):
        if kind != "auto":  # what the cache holds after a quantized round trip
            keys = dequantize_kv(*quantize_kv(keys, kind), kind, torch.float32)
            values = dequantize_kv(*quantize_kv(values, kind), kind, torch.float32)
        rows = slice(s.token_offset, s.token_offset + s.num_query_tokens)
        outs.append(_dense(q[rows], keys, values, s.start_pos, window, sinks))
    return torch.cat(outs)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("mix", MIXES)
def test_quantized_backends_match_dense_on_dequantized_values(kind, mix) -> None:
    q, k, v, full, seqs, cache = _case(mix, seed=len(mix), kind=kind)
    meta = build_attention_metadata(seqs, block_size=BS, device=CPU, dtype=torch.float32)
    expected = _expected(q, full, seqs, kind, None, 0)
    written = {}
    for backend in (TorchReferenceBackend(), TorchSDPABackend()):
        layer = QuantizedLayerCache(
            cache.layer_caches[0].data.clone(), cache.layer_caches[0].scales.clone(), kind
        )
        out = backend.forward(q, k, v, layer, meta)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0, msg=backend.name)
        written[backend.name] = layer
    assert torch.equal(written["torch_ref"].data, written["torch_sdpa"].data)
    assert torch.equal(written["torch_ref"].scales, written["torch_sdpa"].scales)


@pytest.mark.parametrize("kind", ["auto", "int8"])
@pytest.mark.parametrize(("window", "sinks"), [(5, 0), (5, 2), (8, 4), (3, 5)])
@pytest.mark.parametrize("mix", MIXES)
def test_window_with_sinks_matches_dense_mask_with_freed_blocks(kind, window, sinks, mix):
    q, k, v, full, seqs, cache = _case(mix, len(mix) + window, kind, window, sinks)
    assert any(NULL_BLOCK_ID in s.block_ids for s in seqs)  # the case frees blocks
    meta = build_attention_metadata(
        seqs,
        block_size=BS,
        device=CPU,
        dtype=torch.float32,
        sliding_window=window,
        num_sink_tokens=sinks,
    )
    expected = _expected(q, full, seqs, kind, window, sinks)
    for backend in (TorchReferenceBackend(), TorchSDPABackend(), NativeCPUBackend()):
        layer = cache.layer_caches[0]
        layer = (
            QuantizedLayerCache(layer.data.clone(), layer.scales.clone(), kind)
            if isinstance(layer, QuantizedLayerCache)
            else layer.clone()
        )
        out = backend.forward(q, k, v, layer, meta)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0, msg=backend.name)


def test_writing_into_a_freed_block_is_rejected() -> None:
    seqs = [SeqSpec(0, 2, 6, [3, NULL_BLOCK_ID])]
    with pytest.raises(ValueError, match="freed block"):
        build_attention_metadata(seqs, block_size=4, device=CPU, dtype=torch.float32)


def _runner(kind: str, backend: str) -> ModelRunner:
    model, arch = ours_from_hf(tiny_hf_model("llama"), attn_backend=backend)
    return ModelRunner(model, arch, num_blocks=64, block_size=BS, kv_cache_dtype=kind)


@pytest.mark.parametrize("backend", ["torch_sdpa", "torch_ref"])
def test_int8_cache_logits_close_to_full_precision(backend: str) -> None:
    """Prefill 40 tokens in 3 chunks (later chunks read earlier ones from the cache)."""
    from kvserve.core.outputs import SchedulerOutput
    from tests.runtime.runtime_testutil import sched_req

    tokens = [random.Random(3).randrange(97) for _ in range(40)]
    logits = {}
    for kind in ("auto", "int8", "fp8"):
        runner = _runner(kind, backend)
        table = list(range(10, 20))
        rows = []
        for start, end in ((0, 13), (13, 29), (29, 40)):
            batch = runner.prepare_inputs(
                SchedulerOutput(scheduled=[sched_req("a", tokens, start, end, table, False)])
            )
            with torch.inference_mode():
                hidden = runner.model(
                    batch.input_ids, batch.positions, runner.kv_cache.layer_caches, batch.attn_meta
                )
                rows.append(runner.model.compute_logits(hidden))
        logits[kind] = torch.cat(rows)  # [40, vocab]
    ref = logits["auto"]
    spread = ref.std().item()
    assert (logits["int8"] - ref).abs().max().item() < 0.02 * spread
    assert (logits["fp8"] - ref).abs().max().item() < 0.15 * spread
    assert not torch.equal(logits["int8"], ref)  # the cache really was quantized
    assert (logits["int8"].argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95


def test_int8_greedy_generation_matches_full_precision() -> None:
    prompts = {
        f"r{i}": [random.Random(i).randrange(97) for _ in range(9 + 5 * i)] for i in range(3)
    }
    outs = {
        kind: generate(
            _runner(kind, "torch_sdpa"), prompts, 12, token_budget=16, alloc=ToyAllocator(64, BS)
        )
        for kind in ("auto", "int8")
    }
    same = sum(
        a == b for rid in prompts for a, b in zip(outs["auto"][rid], outs["int8"][rid], strict=True)
    )
    assert same >= 0.9 * 3 * 12


def _windowed_runner(kind: str, window: int | None, sinks: int) -> ModelRunner:
    model, arch = ours_from_hf(tiny_hf_model("llama"))
    return ModelRunner(
        model,
        arch,
        num_blocks=64,
        block_size=BS,
        kv_cache_dtype=kind,
        kv_window=window,
        kv_sink_tokens=sinks,
    )


def test_bench_perplexity_through_the_cache() -> None:
    from kvserve.bench.accuracy import agreement, parse_setting, perplexity

    tokens = [random.Random(5).randrange(97) for _ in range(60)]
    ppl = {
        name: perplexity(_windowed_runner(kind, w, 0), tokens, chunk_size=16)
        for name, kind, w in [("auto", "auto", None), ("int8", "int8", None), ("wide", "auto", 64)]
    }
    assert math.isfinite(ppl["auto"]) and ppl["auto"] > 1
    assert ppl["int8"] == pytest.approx(ppl["auto"], rel=0.01)
    assert ppl["int8"] != ppl["auto"]  # the chunks really read a quantized cache
    assert ppl["wide"] == pytest.approx(ppl["auto"], rel=1e-5)  # window covers everything
    assert agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == (0.5, 0.75)
    assert parse_setting("int8-w64s4").kv_window == 64
    with pytest.raises(ValueError, match="unknown"):
        parse_setting("int4")


def test_bench_kl_divergence_and_top1_agreement_against_a_reference() -> None:
    from kvserve.bench.accuracy import teacher_forced

    tokens = [random.Random(6).randrange(97) for _ in range(60)]
    ref = teacher_forced(_windowed_runner("auto", None, 0), tokens, 16, keep_logprobs=True)
    assert ref.logprobs is not None and ref.kl_divergence is None
    assert sum(len(x) for x in ref.logprobs) == len(tokens) - 1
    same = teacher_forced(_windowed_runner("auto", None, 0), tokens, 16, reference=ref.logprobs)
    assert same.kl_divergence == pytest.approx(0.0, abs=1e-9) and same.top1_agreement == 1.0
    assert same.perplexity == ref.perplexity and same.logprobs is None
    int8 = teacher_forced(_windowed_runner("int8", None, 0), tokens, 16, reference=ref.logprobs)
    assert int8.kl_divergence is not None and 0 < int8.kl_divergence < 0.05
    assert int8.top1_agreement is not None and 0.5 < int8.top1_agreement <= 1.0
