"""The bare-runner decode benchmark: repeated decode runs from one prefilled state."""

from __future__ import annotations

import pytest

from kvserve.bench.runtime_speed import decode_weight_bytes, read_bandwidth, run_batch
from kvserve.runtime.model_runner import ModelRunner
from tests.runtime.runtime_testutil import ours_from_hf, tiny_hf_model


def _runner() -> ModelRunner:
    model, arch = ours_from_hf(tiny_hf_model("llama"))
    return ModelRunner(model, arch, num_blocks=32, block_size=4)


def test_repeats_report_the_best_and_the_median_run() -> None:
    r = run_batch(_runner(), batch_size=3, prompt_len=6, steps=5, max_batched_tokens=8, repeats=3)
    assert r["batch_size"] == 3
    assert r["decode_tok_s"] >= r["decode_tok_s_median"] > 0
    assert r["decode_step_ms"] == pytest.approx(1000 * 3 / r["decode_tok_s"])


def test_repeats_must_be_positive() -> None:
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        run_batch(_runner(), batch_size=1, prompt_len=4, steps=3, max_batched_tokens=8, repeats=0)


def test_too_many_sequences_for_the_cache_is_an_error() -> None:
    with pytest.raises(ValueError, match="need more than 32 blocks"):
        run_batch(_runner(), batch_size=20, prompt_len=8, steps=4, max_batched_tokens=8)


def test_profile_covers_one_decode_run() -> None:
    r = run_batch(
        _runner(), batch_size=2, prompt_len=5, steps=3, max_batched_tokens=8, profile=True
    )
    assert "aten::mm" in r["profile"]
    assert "Self CPU time total" in r["profile"]


def test_decode_weight_bytes_counts_each_weight_once() -> None:
    model, arch = ours_from_hf(tiny_hf_model("llama"))
    every = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in every.values())
    embed = model.embed_tokens.numel() * model.embed_tokens.element_size()
    if model.lm_head is model.embed_tokens:
        assert decode_weight_bytes(model) == total  # the lm_head reads the tied matrix
    else:
        assert decode_weight_bytes(model) == total - embed  # only T rows of the input table


def test_read_bandwidth_is_a_positive_rate() -> None:
    assert read_bandwidth(nbytes=1 << 20, repeats=2) > 0


def test_floor_runs_the_same_matmuls_after_each_decode_run() -> None:
    r = run_batch(
        _runner(), batch_size=2, prompt_len=5, steps=4, max_batched_tokens=8, repeats=2, floor=True
    )
    assert r["floor_tok_s"] >= r["floor_tok_s_median"] > 0
    assert r["decode_vs_floor"] > 0
    assert "floor_tok_s" not in run_batch(
        _runner(), batch_size=2, prompt_len=5, steps=3, max_batched_tokens=8
    )
