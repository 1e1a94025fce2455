"""LLMEngine's request bookkeeping on a tiny random-weight Llama: ids, n > 1 outputs, metrics.

Every test ends with the KV pool idle and no per-request state left.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model

PROMPT = [300 + 7 * j for j in range(9)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def _engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(
        model=str(model_dir), block_size=4, max_model_len=64, num_threads=1, num_kv_blocks=96
    )


def _run(engine: LLMEngine) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        outputs += engine.step()
        engine.kv_cache_manager.check_integrity()
    return outputs


def _assert_idle(engine: LLMEngine) -> None:
    engine.kv_cache_manager.check_integrity()
    assert engine.stats()["kv_usage"] == 0
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    assert not engine.has_unfinished_requests() and engine.num_request_states == 0


def test_e2e_of_an_n_request_ends_with_its_last_sample(model_dir: Path) -> None:
    """The final output's e2e runs to the finish of the request's last sample (a forked
    sample samples its first token a step after the parent, so it ends a step later)."""
    engine = _engine(model_dir)
    params = SamplingParams(max_tokens=3, n=2, ignore_eos=True, temperature=0.8, seed=1)
    engine.add_request(PROMPT, params, request_id="a")
    samples = [engine.scheduler.get_request(rid) for rid in ("a", "a#1")]
    outputs = _run(engine)
    finals = [o for o in outputs if o.finished]
    assert len(finals) == 1 and finals[0] is outputs[-1]
    assert [c.finish_reason for c in finals[0].outputs] == ["length", "length"]
    last = max(s.finished_time for s in samples if s is not None)
    assert samples[0] is not None and samples[0].finished_time < last
    metrics = finals[0].metrics
    assert metrics is not None and metrics.e2e == last - samples[0].arrival_time
    _assert_idle(engine)
