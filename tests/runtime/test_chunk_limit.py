"""Which prefill chunks attend through the native decode kernel: the per-row tables that let
them, and the start-up measurement that sets the limit (kvserve/runtime/native/chunk_limit.py).
"""

from __future__ import annotations

import logging

import pytest
import torch

from kvserve.config import ModelArchConfig
from kvserve.engine import LLMEngine
from kvserve.models.loader import default_model_path
from kvserve.runtime import native
from kvserve.runtime.attention import SeqSpec, build_attention_metadata
from kvserve.runtime.native import chunk_limit
from kvserve.runtime.native.backend import NativeCPUBackend
from kvserve.runtime.native.chunk_limit import (
    chunk_attention_limit,
    limit_from_timings,
    probe_rows,
)

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


def test_limit_is_the_last_size_before_the_kernel_loses() -> None:
    t = {16: (1.0, 2.0), 32: (2.0, 2.5), 64: (5.0, 4.0), 128: (1.0, 9.0)}
    assert limit_from_timings(t, 512) == 32  # 128 does not count: 64 lost first
    assert limit_from_timings({16: (3.0, 2.0)}, 512) == 0
    assert limit_from_timings({16: (1.0, 2.0), 32: (1.0, 1.0)}, 512) == 512  # never slower
    assert limit_from_timings({}, 512) == 0


def test_limit_is_measured_once_then_cached(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    calls: list[tuple[int, bool]] = []

    def timer(n: int, kernel: bool) -> float:  # the kernel loses from 128 rows on
        calls.append((n, kernel))
        return (n * n if n >= 128 else n) * 1e-6 if kernel else n * 4e-6

    with caplog.at_level(logging.INFO, logger="kvserve"):
        assert chunk_attention_limit(ARCH, torch.float32, 512, timer=timer) == 64
    assert "the decode kernel up to 64 rows" in caplog.text
    assert {n for n, _ in calls} == {16, 32, 64, 128}  # stops at the first loss
    assert {k for _, k in calls} == {True, False}  # both ways timed
    calls.clear()
    assert chunk_attention_limit(ARCH, torch.float32, 512, timer=timer) == 64
    assert calls == []  # from the cache
    # another dtype or budget is another key; "measure" measures again; "off" is 0
    assert chunk_attention_limit(ARCH, torch.bfloat16, 512, timer=timer) == 64 and calls
    calls.clear()
    assert chunk_attention_limit(ARCH, torch.float32, 512, timer=timer, mode="measure") == 64
    assert calls
    assert chunk_attention_limit(ARCH, torch.float32, 512, timer=timer, mode="off") == 0


def test_corrupt_cache_is_measured_again(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    assert chunk_attention_limit(ARCH, torch.float32, 32, timer=lambda n, k: 1.0 if k else 2.0)
    (path,) = tmp_path.rglob("chunkattn_*.json")
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert (
            chunk_attention_limit(ARCH, torch.float32, 32, timer=lambda n, k: 2.0 if k else 1.0)
            == 0
        )
    assert "is corrupt" in caplog.text


@pytest.mark.skipif(not native.available(), reason="native kernels unavailable")
def test_real_probe_runs_both_paths(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    probe = chunk_limit.ChunkAttentionProbe(ARCH, torch.float32)
    assert probe(16, True) > 0 and probe(16, False) > 0
    limit = chunk_attention_limit(ARCH, torch.float32, 64, mode="measure", budget_s=0.0)
    assert limit in (0, 16, 32, 64)


@pytest.mark.skipif(not native.available(), reason="native kernels unavailable")
def test_engine_gives_its_backend_the_measured_limit(monkeypatch) -> None:
    asked = []

    def limit(arch: ModelArchConfig, dtype: torch.dtype, budget: int, mode: str) -> int:
        asked.append((dtype, budget, mode))
        return 48

    monkeypatch.setattr("kvserve.engine_startup.chunk_attention_limit", limit)
    engine = LLMEngine(
        model=default_model_path(), max_num_batched_tokens=64, dtype="float32", max_model_len=256
    )
    assert asked == [(torch.float32, 64, "auto")]
    backend = engine.runner.model.attn_backend
    assert isinstance(backend, NativeCPUBackend) and backend.chunk_kernel_max_tokens == 48
