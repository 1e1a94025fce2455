"""KV cache quantization and windowed eviction through the public LLM API (embedded model)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvserve import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "def fibonacci(n):",
]
KV_MEMORY = 64 << 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def runs(make_llm: Callable[..., object]) -> dict[str, tuple[dict, list[list[int]]]]:
    results = {}
    for kind in ("auto", "int8", "fp8"):
        llm = make_llm(kv_cache_dtype=kind, kv_cache_memory=KV_MEMORY, max_model_len=512)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        results[kind] = (llm.stats(), [o.outputs[0].token_ids for o in outs])
    return results


def test_quantized_cache_holds_about_4x_the_tokens(runs) -> None:
    auto, int8, fp8 = runs["auto"][0], runs["int8"][0], runs["fp8"][0]
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, K and V.
    assert auto["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert int8["kv_bytes_per_token"] == fp8["kv_bytes_per_token"] == 2 * 30 * 3 * (64 + 4)
    assert int8["num_kv_blocks"] >= 3.7 * auto["num_kv_blocks"]
    assert int8["memory"]["kv_cache_bytes"] <= KV_MEMORY


def test_quantized_greedy_outputs_agree_with_full_precision(runs) -> None:
    ref = runs["auto"][1]
    for kind in ("int8", "fp8"):
        outs = runs[kind][1]
        prefix = []
        for a, b in zip(ref, outs, strict=True):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            prefix.append(n / len(a))
        # int8 is near-lossless on this model; fp8 (3 mantissa bits) may diverge later.
        assert sum(prefix) / len(prefix) >= (0.9 if kind == "int8" else 0.5), (kind, prefix)


def test_windowed_eviction_frees_blocks_and_bounds_usage(make_llm) -> None:
    llm = make_llm(
        kv_window=32, kv_sink_tokens=4, num_kv_blocks=64, block_size=16, max_model_len=512
    )
    prompt = " ".join(f"item {i} is number {i * 7};" for i in range(40))  # ~400 tokens
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 24
    stats = llm.stats()
    num_tokens = len(out[0].prompt_token_ids) + 24
    # Every block but the sink block, the window and the block being written was freed.
    assert stats["window_freed_blocks"] >= -(-num_tokens // 16) - 1 - 2 - 1
    assert stats["num_free_blocks"] == 64 and stats["kv_usage"] == 0
    assert stats["prefix_cache_queries"] == 0  # prefix caching is off when windowed


def test_windowed_request_longer_than_the_pool_runs(make_llm) -> None:
    """A windowed request needs only the blocks it holds at once: ~424 tokens run in a
    16-block pool of 16-token blocks (256 tokens) when the step budget is 64 tokens, with
    the same greedy tokens as in a pool that holds them all."""
    prompt = " ".join(f"item {i} is number {i * 7};" for i in range(40))  # ~400 tokens
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outs = {}
    for blocks in (16, 64):
        llm = make_llm(
            kv_window=32,
            kv_sink_tokens=4,
            num_kv_blocks=blocks,
            block_size=16,
            max_model_len=512,
            max_num_batched_tokens=64,
        )
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert len(out.prompt_token_ids) + 24 > 16 * 16
        outs[blocks] = out.outputs[0].token_ids
        assert llm.stats()["num_free_blocks"] == blocks
    assert len(outs[16]) == 24
    assert outs[16] == outs[64]
