"""The contiguous allocator mode through the real engine on a tiny random-weight Llama.

Where KV lives must not change a greedy token: the contiguous mode, with a pool so small that
requests wait for a free run, gives exactly the paged mode's outputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.core.kv.contiguous import ContiguousKVCacheManager
from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model

BLOCK_SIZE = 4
# (prompt length, max_tokens): reservations of 4 to 9 blocks.
LENGTHS = [(5, 11), (13, 4), (3, 20), (17, 9), (8, 8), (2, 30), (11, 6), (6, 14)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def _run(engine: LLMEngine, n: int = 1) -> tuple[list[list[list[int]]], int]:
    """Every request queued at once; returns (token ids per request and sample, peak running)."""
    ids = []
    for i, (num_prompt, max_tokens) in enumerate(LENGTHS):
        prompt = [100 + 37 * i + 11 * j for j in range(num_prompt)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)
        ids.append(engine.add_request(prompt, params, request_id=f"r{i}"))
    finals = {}
    peak = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = [c.token_ids for c in out.outputs]
        peak = max(peak, engine.scheduler.num_running)
        engine.kv_cache_manager.check_integrity()
    return [finals[i] for i in ids], peak


def _engine(model_dir: Path, **kwargs: object) -> LLMEngine:
    kwargs.setdefault("num_threads", 1)
    return LLMEngine(model=str(model_dir), block_size=BLOCK_SIZE, max_model_len=64, **kwargs)


@pytest.mark.parametrize("n", [1, 2])
def test_contiguous_outputs_equal_paged_outputs(model_dir: Path, n: int) -> None:
    paged = _engine(model_dir, num_kv_blocks=128)
    expected, paged_peak = _run(paged, n)
    assert paged_peak == len(LENGTHS) * n
    # 16 blocks: one or two reservations at a time, the others wait for a free run.
    contiguous = _engine(model_dir, num_kv_blocks=16, kv_allocator="contiguous")
    kv = contiguous.kv_cache_manager
    assert isinstance(kv, ContiguousKVCacheManager) and not kv.enable_prefix_caching
    got, peak = _run(contiguous, n)
    assert got == expected
    assert [len(s[0]) for s in got] == [m for _, m in LENGTHS]
    assert 1 <= peak < len(LENGTHS)
    stats = contiguous.stats()
    assert stats["kv_usage"] == 0 and stats["num_free_blocks"] == 16
    assert stats["prefix_cache_queries"] == 0
    if n == 1:
        assert stats["preemptions"] == 0  # a reservation never needs another block


def test_contiguous_engine_reports_truthful_utilization(model_dir: Path) -> None:
    engine = _engine(model_dir, num_kv_blocks=32, kv_allocator="contiguous")
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=11, ignore_eos=True))
    engine.step()  # prefill: 5 tokens stored (all computed) in a 16-token reservation
    snap = engine.kv_cache_manager.snapshot()
    assert snap["kv_usage"] == 4 / 32
    assert snap["kv_utilization"] == pytest.approx(5 / 16)
    assert snap["largest_free_run_blocks"] == 28


def test_config_rejects_combinations_that_make_no_sense() -> None:
    with pytest.raises(ValueError, match="kv_allocator must be"):
        EngineConfig(kv_allocator="buddy")
    with pytest.raises(ValueError, match="kv_window"):
        EngineConfig(kv_allocator="contiguous", kv_window=64)
    with pytest.raises(ValueError, match="enable_host_prefix_cache"):
        EngineConfig(kv_allocator="contiguous", enable_host_prefix_cache=True)
    assert EngineConfig(kv_allocator="contiguous").kv_allocator == "contiguous"
