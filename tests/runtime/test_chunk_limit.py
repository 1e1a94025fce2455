"""Which prefill chunks attend through the native decode kernel: the per-row tables that let
them, and the start-up measurement that sets the limit (kvserve/runtime/native/chunk_limit.py).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from kvserve.config import ModelArchConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.runtime import native
from kvserve.runtime.attention.metadata import SeqSpec, build_attention_metadata
from kvserve.runtime.attention.native_cpu import NativeCPUBackend, amx_prefill_available
from kvserve.runtime.attention.sdpa import TorchSDPABackend
from kvserve.runtime.native import chunk_limit
from kvserve.runtime.native.chunk_limit import (
    INVARIANT,
    ChunkAttention,
    choice_from_timings,
    chunk_attention_limit,
    configure_backend,
    probe_rows,
)
from tests.tiny_models import make_tiny_model

ARCH = ModelArchConfig(
    architecture="llama",
    max_position_embeddings=4096,
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


def test_query_tables_give_every_row_its_table_and_causal_length() -> None:
    # a decode at position 5, a chunk of 3 at positions 6..8, a fresh prompt of 2
    seqs = [SeqSpec(0, 1, 5, [7, 2]), SeqSpec(1, 3, 6, [4, 9, 1]), SeqSpec(4, 2, 0, [3])]
    meta = build_attention_metadata(
        seqs, block_size=4, device=torch.device("cpu"), dtype=torch.float32
    )
    tables, lens = meta.query_tables
    assert tables.dtype == torch.int32 and lens.dtype == torch.int32
    assert tables.tolist() == [[7, 2, 0], [4, 9, 1], [4, 9, 1], [4, 9, 1], [3, 0, 0], [3, 0, 0]]
    assert lens.tolist() == [6, 7, 8, 9, 1, 2]
    assert meta.query_tables[0] is tables  # built once a step, shared by the layers


def test_probe_rows_stop_at_the_token_budget() -> None:
    assert probe_rows(64) == [16, 32, 64]
    assert probe_rows(100) == [16, 32, 64, 100]
    assert probe_rows(8) == [8]
    assert probe_rows(10_000) == list(chunk_limit.PROBE_ROWS)
    assert probe_rows(0) == []


def test_choice_is_the_last_size_before_the_kernel_loses() -> None:
    def t(kernel: float, sdpa: float, f32: float | None = None) -> dict[str, float]:
        return {"kernel": kernel, "sdpa": sdpa} | ({} if f32 is None else {"sdpa_float32": f32})

    timings = {16: t(1, 2), 32: t(2, 2.5), 64: t(5, 4), 128: t(1, 9)}
    assert choice_from_timings(timings, 512) == ChunkAttention(32, False)  # 64 lost first
    # the kernel loses to SDPA in float32 only: float32 serves the longer chunks
    assert choice_from_timings({16: t(1, 2, 3), 32: t(3, 4, 2)}, 512) == ChunkAttention(16, True)
    assert choice_from_timings({16: t(3, 2, 2.5)}, 512) == ChunkAttention(0, False)
    assert choice_from_timings({16: t(1, 2, 1.5), 32: t(1, 1, 1)}, 512) == ChunkAttention(512)
    assert choice_from_timings({}, 512) == ChunkAttention(0, False)
    # the AMX kernel timed: faster than SDPA where the decode kernel first loses -> it serves
    # the longer chunks (SDPA in float32 what it cannot)
    amx = {16: t(1, 2, 3) | {"amx": 1.5}, 32: t(3, 4, 2) | {"amx": 1}}
    assert choice_from_timings(amx, 512) == ChunkAttention(16, True, True)
    # faster than the decode kernel but not SDPA's loss: the decode kernel keeps its chunks
    # (its steps run fused), the AMX kernel is not used
    assert choice_from_timings({16: t(2, 3, 4) | {"amx": 1}}, 512) == ChunkAttention(512)
    # timed but slower than SDPA in float32 there: SDPA in float32 serves the long chunks
    assert choice_from_timings({16: t(3, 4, 1) | {"amx": 2}}, 512) == ChunkAttention(0, True)


def test_chunk_ways_add_the_amx_kernel_for_bf16_head_dim_64(monkeypatch) -> None:
    monkeypatch.setattr(chunk_limit, "amx_prefill_available", lambda: True)
    d64 = dataclasses.replace(ARCH, head_dim=64)
    assert chunk_limit.chunk_ways(d64, torch.bfloat16) == ("kernel", "sdpa", "sdpa_float32", "amx")
    assert chunk_limit.chunk_ways(d64, torch.float16) == ("kernel", "sdpa", "sdpa_float32")
    assert chunk_limit.chunk_ways(d64, torch.float32) == ("kernel", "sdpa")
    assert chunk_limit.chunk_ways(ARCH, torch.bfloat16) == ("kernel", "sdpa", "sdpa_float32")
    monkeypatch.setattr(chunk_limit, "amx_prefill_available", lambda: False)
    assert chunk_limit.chunk_ways(d64, torch.bfloat16) == ("kernel", "sdpa", "sdpa_float32")


def test_choice_is_measured_once_then_cached(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    calls: list[tuple[int, str]] = []

    def timer(n: int, way: str) -> float:  # the kernel loses from 128 rows on
        calls.append((n, way))
        if way == "kernel":
            return (n * n if n >= 128 else n) * 1e-6
        return n * (4e-6 if way == "sdpa" else 3e-6)

    with caplog.at_level(logging.INFO, logger="kvserve"):
        choice = chunk_attention_limit(ARCH, torch.bfloat16, 512, timer=timer)
    assert choice == ChunkAttention(64, True)
    assert "the decode kernel up to 64 rows, SDPA in float32 above" in caplog.text
    assert {n for n, _ in calls} == {16, 32, 64, 128}  # stops at the first loss
    assert {w for _, w in calls} == {"kernel", "sdpa", "sdpa_float32"}
    calls.clear()
    assert chunk_attention_limit(ARCH, torch.bfloat16, 512, timer=timer) == choice
    assert calls == []  # from the cache
    # a float32 model has no float32 SDPA to try; another dtype or budget is another key
    assert chunk_attention_limit(ARCH, torch.float32, 512, timer=timer) == ChunkAttention(64)
    assert {w for _, w in calls} == {"kernel", "sdpa"}
    calls.clear()
    assert chunk_attention_limit(ARCH, torch.bfloat16, 512, timer=timer, mode="measure") == choice
    assert calls
    off = chunk_attention_limit(ARCH, torch.bfloat16, 512, timer=timer, mode="off")
    assert off == ChunkAttention(0, False)


def test_corrupt_cache_is_measured_again(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))

    def kernel_wins(n: int, way: str) -> float:
        return 1.0 if way == "kernel" else 2.0

    assert chunk_attention_limit(ARCH, torch.float32, 32, timer=kernel_wins).max_kernel_tokens
    (path,) = tmp_path.rglob("chunkattn_*.json")
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        again = chunk_attention_limit(
            ARCH, torch.float32, 32, timer=lambda n, w: 3.0 - kernel_wins(n, w)
        )
    assert again == ChunkAttention(0, False)
    assert "is corrupt" in caplog.text


def test_sdpa_in_float32_matches_the_half_precision_path() -> None:
    """A bf16 chunk through SDPA in float32 agrees with bf16 SDPA within bf16 rounding."""
    gen = torch.Generator().manual_seed(3)
    n, start, bs = 24, 40, 16
    blocks = list(range(-(-(start + n) // bs)))
    meta = build_attention_metadata(
        [SeqSpec(0, n, start, blocks)],
        block_size=bs,
        device=torch.device("cpu"),
        dtype=torch.bfloat16,
    )
    cache = torch.randn(2, len(blocks), bs, 2, 8, generator=gen).to(torch.bfloat16)
    qkv = torch.randn(n, 8, 8, generator=gen).to(torch.bfloat16)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    half = NativeCPUBackend().forward(q, k, v, cache.clone(), meta)
    f32 = NativeCPUBackend(chunk_sdpa_float32=True).forward(q, k, v, cache.clone(), meta)
    assert f32.dtype == torch.bfloat16
    torch.testing.assert_close(f32.float(), half.float(), atol=2e-2, rtol=0)


@pytest.mark.skipif(not native.available(), reason="native kernels unavailable")
def test_real_probe_runs_both_paths(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    for dtype in (torch.float32, torch.bfloat16):
        probe = chunk_limit.ChunkAttentionProbe(ARCH, dtype)
        assert all(probe(16, way) > 0 for way in chunk_limit.WAYS)
        choice = chunk_attention_limit(ARCH, dtype, 64, mode="measure", budget_s=0.0)
        assert choice.max_kernel_tokens in (0, 16, 32, 64)


@pytest.mark.skipif(not amx_prefill_available(), reason="the AMX prefill kernel does not run here")
def test_real_probe_times_the_amx_kernel(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    d64 = dataclasses.replace(ARCH, num_attention_heads=6, num_key_value_heads=2, head_dim=64)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        chunk_attention_limit(d64, torch.bfloat16, 32, mode="measure", budget_s=0.0)
    assert "kernel / sdpa / sdpa_float32 / amx" in caplog.text


@pytest.mark.skipif(not native.available(), reason="native kernels unavailable")
def test_engine_gives_its_backend_the_measured_limit(monkeypatch, tmp_path) -> None:
    asked = []

    def limit(arch: ModelArchConfig, dtype: torch.dtype, budget: int, mode: str) -> ChunkAttention:
        asked.append((dtype, budget, mode))
        return ChunkAttention(48, True)

    monkeypatch.setattr("kvserve.runtime.native.chunk_limit.chunk_attention_limit", limit)
    # NOTE: a tiny model: the per-bucket kernel selection (not the invariant one) measures
    # every shape anew, 60 s on the embedded model's.
    engine = LLMEngine(
        model=make_tiny_model(tmp_path, "llama"),
        max_num_batched_tokens=64,
        dtype="float32",
        max_model_len=256,
        batch_invariant=False,
    )
    assert asked == [(torch.float32, 64, "auto")]
    backend = engine.runner.model.attn_backend
    assert isinstance(backend, NativeCPUBackend) and backend.chunk_kernel_max_tokens == 48
    assert backend.chunk_sdpa_float32


def test_batch_invariant_backend_takes_every_row_through_the_decode_kernel(monkeypatch) -> None:
    """Nothing measured: every chunk, however long, attends as decode queries."""

    def limit(*args: object, **kwargs: object) -> ChunkAttention:
        raise AssertionError("measured under batch invariance")

    monkeypatch.setattr("kvserve.runtime.native.chunk_limit.chunk_attention_limit", limit)
    backend = NativeCPUBackend(16, chunk_sdpa_float32=True, chunk_amx=True)
    configure_backend(
        backend, ARCH, torch.float32, 512, mode="auto", device="cpu", batch_invariant=True
    )
    assert ChunkAttention.of(backend) == INVARIANT == ChunkAttention(2**31 - 1)
    # a decode, then a prompt of 2,048 tokens in one chunk
    seqs = [SeqSpec(0, 1, 5, [7, 2]), SeqSpec(1, 2048, 0, list(range(1, 129)))]
    meta = build_attention_metadata(
        seqs, block_size=16, device=torch.device("cpu"), dtype=torch.float32
    )
    plan = backend.kernel_rows(meta)
    assert plan.rest == () and plan.end == 2049


def test_choice_read_back_from_a_backend_and_applied_to_another() -> None:
    choice = ChunkAttention.of(NativeCPUBackend(5, chunk_sdpa_float32=True, chunk_amx=True))
    assert choice == ChunkAttention(5, True, True)
    assert ChunkAttention.of(TorchSDPABackend()) is None
    other = NativeCPUBackend()
    choice.apply(other)
    assert (other.chunk_kernel_max_tokens, other.chunk_sdpa_float32, other.chunk_amx) == (
        5,
        True,
        True,
    )
    assert choice.summary() == (
        "the decode kernel up to 5 rows, the AMX prefill kernel above "
        "(SDPA in float32 where it cannot serve)"
    )
    with pytest.raises(ValueError, match="chunk_kernel_max_tokens must be >= 0"):
        NativeCPUBackend(-1)
