"""LLMEngine's request bookkeeping on a tiny random-weight Llama: ids, n > 1 outputs, metrics.

Every test ends with the KV pool idle and no per-request state left.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from tests.e2e.engine_steps import small_engine
from tests.tiny_models import make_tiny_model

PROMPT = [300 + 7 * j for j in range(9)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


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
    engine = small_engine(model_dir)
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


def test_top_k_above_the_vocabulary_samples_as_top_k_disabled(model_dir: Path) -> None:
    engine = small_engine(model_dir)
    vocab = engine.arch.vocab_size
    tokens = {}
    for top_k in (-1, vocab + 1000):
        params = SamplingParams(temperature=1.0, seed=11, top_k=top_k, max_tokens=12, n=2)
        rid = engine.add_request(PROMPT, params)
        finals = [o for o in _run(engine) if o.request_id == rid and o.finished]
        tokens[top_k] = [c.token_ids for c in finals[0].outputs]
    assert tokens[vocab + 1000] == tokens[-1]
    assert len({t for ids in tokens[-1] for t in ids}) > 4  # sampled, not one repeated token
    assert engine.kv_cache_manager.usage == 0.0 and engine.num_request_states == 0


def test_an_id_of_a_live_requests_sample_is_in_use(model_dir: Path) -> None:
    """While request "a" (n=2) runs, "a#1" names its second sample, finished or not; the id
    is free again once "a" ends (before, a request added as "a#1" after that sample finished
    lost its bookkeeping when "a" ended: it never got an output)."""
    engine = small_engine(model_dir)
    params = SamplingParams(max_tokens=6, n=2, ignore_eos=True, temperature=1.0, seed=3)
    engine.add_request(PROMPT, params, request_id="a")
    tokens = {c.index: c.token_ids for c in _run(engine)[-1].outputs}
    stop = tokens[1][0]  # the second sample's first token ends it there
    assert stop not in tokens[0]
    params = SamplingParams(
        max_tokens=6, n=2, ignore_eos=True, temperature=1.0, seed=3, stop_token_ids=[stop]
    )
    engine.add_request(PROMPT, params, request_id="a")
    outputs: list[RequestOutput] = []
    while not outputs or outputs[-1].outputs[1].finish_reason is None:
        outputs += engine.step()
    assert outputs[-1].outputs[0].finish_reason is None  # "a" runs on
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=2), request_id="a#1")
    finals = [o for o in _run(engine) if o.finished]
    assert [o.request_id for o in finals] == ["a"]
    engine.add_request(PROMPT, SamplingParams(max_tokens=2), request_id="a#1")
    finals = [o for o in _run(engine) if o.finished]
    assert [o.request_id for o in finals] == ["a#1"]
    _assert_idle(engine)
