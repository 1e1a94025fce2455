"""Async scheduling end to end (``EngineConfig.async_scheduling``) on a tiny random Llama.

The same engine settings with async scheduling off and on must give the same outputs: greedy
and seeded tokens, texts and finish reasons, with requests that finish while the step after
theirs is already scheduled (a stop token, stop strings, max_tokens), n > 1 samples, an
abort while a step is in flight and a request failing for its own fault. The settings force
the rest: a KV pool of 12 blocks (recompute preemptions), a 32-token budget (chunked
prefill) and a shared system prompt (prefix hits). Every run ends with the pool idle and
its integrity intact.
"""

from __future__ import annotations

import pytest

from kvserve.engine.fault_injection import REQUEST_FAULT_MARKER, install
from kvserve.sampling_params import SamplingParams
from kvserve.structured.spec import StructuredOutputsParams
from tests.e2e.prompts import QUESTIONS, SYSTEM
from tests.tiny_models import make_tiny_model

SETTINGS = dict(
    block_size=16,
    num_kv_blocks=12,
    max_num_batched_tokens=32,
    max_model_len=256,
    admission_headroom=0.0,
    resume_watermark=0.0,
)


def _prompts(tokenizer, questions=QUESTIONS) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        )
        for q in questions
    ]


@pytest.fixture(scope="module")
def llms(make_llm, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """(synchronous, async) LLMs with the same settings."""
    model = str(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"))
    sync = make_llm(model=model, **SETTINGS)
    return sync, make_llm(model=model, async_scheduling=True, **SETTINGS)


def _idle(llm) -> None:  # type: ignore[no-untyped-def]
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.kv_cache_manager.check_integrity()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    assert engine.num_request_states == 0


def _run(llm, prompts, params) -> list[tuple]:  # type: ignore[no-untyped-def]
    outs = llm.generate(prompts, params, use_tqdm=False)
    _idle(llm)
    return [
        (o.error, [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs])
        for o in outs
    ]


def test_greedy_outputs_match_with_stops_preemption_and_prefix_hits(llms) -> None:  # type: ignore[no-untyped-def]
    sync, asyn = llms
    prompts = _prompts(sync.tokenizer)
    probe = sync.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=9))
    stop_id = probe[0].outputs[0].token_ids[5]  # its 6th token ends it below
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.0, max_tokens=7),
        SamplingParams(temperature=0.0, max_tokens=40, stop=[" the", "."]),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop=["e"]),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]
    before = asyn.engine.stats()["preemptions"]
    expected = _run(sync, prompts, params)
    got = _run(asyn, prompts, params)
    assert got == expected
    assert expected[0][1][0][3] == stop_id and len(expected[0][1][0][0]) <= 6
    reasons = {c[2] for _, cs in expected for c in cs}
    assert reasons == {"stop", "length"}
    assert asyn.engine.stats()["preemptions"] > before  # the tiny pool preempted
    assert asyn.engine.stats()["prefix_cache_hits"] > 0  # the system prompt was hit


def test_seeded_samples_match(llms) -> None:  # type: ignore[no-untyped-def]
    sync, asyn = llms
    prompts = _prompts(sync.tokenizer, QUESTIONS[:3])
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, n=2)
    assert _run(asyn, prompts, params) == _run(sync, prompts, params)


def _step_with_abort(llm, prompts) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ids = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    finals: dict[str, list[int]] = {}
    for i in range(200):
        if not engine.has_unfinished_requests():
            break
        if i == 4:
            engine.abort_request(ids[1])
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = list(out.outputs[0].token_ids)
    _idle(llm)
    assert ids[1] not in finals
    return finals


def test_abort_while_a_step_is_in_flight(llms) -> None:  # type: ignore[no-untyped-def]
    sync, asyn = llms
    prompts = _prompts(sync.tokenizer, QUESTIONS[:3])
    assert _step_with_abort(asyn, prompts) == _step_with_abort(sync, prompts)


def test_a_request_failing_on_its_own_fault(llms) -> None:  # type: ignore[no-untyped-def]
    """The faulted request fails alone (its prompt shares no block with the others)."""
    sync, asyn = llms
    prompts = [f"Say {w} twice." for w in ("red", f"{REQUEST_FAULT_MARKER} blue", "green")]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = []
    for llm in (sync, asyn):
        execute = llm.engine.runner.execute
        install(llm.engine)
        try:
            # NOTE: the error names the request id, which the LLM numbers per engine.
            results.append([(e is None, c) for e, c in _run(llm, prompts, params)])
        finally:
            llm.engine.runner.execute = execute
    assert results[0] == results[1]
    assert [ok for ok, _ in results[1]] == [True, False, True]


def test_structured_outputs_match(llms) -> None:  # type: ignore[no-untyped-def]
    """A constrained request's next bitmask needs its last token: it is computed once that
    token is in, before the step scheduled ahead runs."""
    sync, asyn = llms
    prompts = _prompts(sync.tokenizer, QUESTIONS[:4])
    constraints = [
        StructuredOutputsParams(regex=r"[a-z]{3,8}( [0-9]{1,3}){2}"),
        StructuredOutputsParams(choice=["yes", "no", "maybe not"]),
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
        None,
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=c) for c in constraints
    ]
    expected = _run(sync, prompts, params)
    assert _run(asyn, prompts, params) == expected
    assert expected[1][1][0][1] in ("yes", "no", "maybe not")
