"""Fault isolation of structured output through the real engine (llguidance matchers) on a
tiny random-weight Llama with the embedded tokenizer.

A grammar-engine exception for one request (building its mask before the forward, consuming
its sampled token after it) fails that request alone, with an error: the other requests,
constrained or not, finish with exactly the tokens of a run without it, nothing leaks and the
engine serves on. A grammar that dead-ends (no token can extend the output) ends its request
with EOS at once (vLLM's behaviour), never with garbage tokens or a run to max_tokens; one
whose matcher runs out of a grammar-engine limit fails with an error, never "stop": finish
reason "error" with its text so far (through the server: a 200 not streamed, an error event
streamed).
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.app import build_app
from kvserve.structured import StructuredOutputsParams as S
from tests.e2e.engine_steps import drain, small_engine
from tests.tiny_models import make_tiny_model

SPECS: dict[str, S | None] = {
    "r0": S(regex="[a-z]{2,12}"),
    "r1": S(choice=["alpha", "beta", "gamma"]),
    "r2": S(regex="[0-9]{3,9}"),
    "r3": None,
    "r4": S(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
}
N_OF = {"r4": 2}  # forked samples, each with its own matcher copy
# NOTE: "x", then a terminal whose language is empty: after "x" no token is allowed.
DEAD_AFTER_X = 'start: "x" B\nB: /[a-z]+/ & ~/[a-z]+/'
DEAD_AT_START = "start: A\nA: /a/ & /b/"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def _add_all(
    engine: LLMEngine, skip: str | None = None, override: dict[str, S] | None = None, **kw: Any
) -> None:
    for i, (rid, spec) in enumerate(SPECS.items()):
        if rid == skip:
            continue
        spec = (override or {}).get(rid, spec)
        params = SamplingParams(
            temperature=0.0, max_tokens=10, structured_outputs=spec, n=N_OF.get(rid, 1), **kw
        )
        engine.add_request([300 + 7 * j for j in range(5 + i)], params, request_id=rid)


def _drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    return drain(engine, max_steps=100)


def _tokens(out: RequestOutput) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def _assert_no_leak(engine: LLMEngine) -> None:
    kv = engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks
    assert engine.num_request_states == 0 and engine.structured.num_matchers == 0


class RaisingMatcher:
    """Stands in for one request's llguidance matcher: ``method`` raises from its
    ``on_call``-th call on (a grammar-engine bug); everything else is the real matcher."""

    def __init__(self, real: Any, method: str, on_call: int) -> None:
        self.real, self.method, self.on_call = real, method, on_call
        self.num_calls = self.num_raised = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.real, name)
        if name != self.method:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.num_calls += 1
            if self.num_calls >= self.on_call:
                self.num_raised += 1
                raise RuntimeError(f"grammar engine bug in {name}")
            return attr(*args, **kwargs)

        return call


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[str, RequestOutput]:
    """Every request but r1 (the one that will fault), unfaulted."""
    engine = small_engine(model_dir)
    _add_all(engine, skip="r1")
    return _drain(engine)


@pytest.mark.parametrize(
    ("method", "phase"),
    [("unsafe_compute_mask_ptr", "computing the mask"), ("consume_token", "consuming")],
    ids=["prepare", "update"],
)
def test_grammar_engine_fault_fails_only_its_request(
    model_dir: Path, expected: dict[str, RequestOutput], method: str, phase: str
) -> None:
    engine = small_engine(model_dir)
    _add_all(engine)
    state = engine.structured._states["r1"]
    # NOTE: the second call raises: r1 has sampled a constrained token before its fault.
    faulty = RaisingMatcher(state.matcher, method, on_call=2)
    state.matcher = faulty
    got = _drain(engine)
    assert faulty.num_raised == 1
    r1 = got["r1"]
    assert r1.error is not None and phase in r1.error and "grammar engine bug" in r1.error
    assert r1.outputs[0].finish_reason == "abort" and len(r1.outputs[0].token_ids) >= 1
    assert set(got) == set(SPECS)
    for rid, out in expected.items():
        assert got[rid].error is None
        assert _tokens(got[rid]) == _tokens(out), rid
    assert engine.stats()["num_failed_requests"] == 1
    assert engine.structured.stats.num_faults == 1
    _assert_no_leak(engine)
    # The engine serves on: the same requests again (r1 with a healthy matcher) all succeed.
    _add_all(engine)
    again = _drain(engine)
    assert all(out.error is None for out in again.values())
    assert {rid: _tokens(o) for rid, o in again.items() if rid != "r1"} == {
        rid: _tokens(o) for rid, o in expected.items()
    }
    assert again["r1"].outputs[0].text in ("alpha", "beta", "gamma")
    _assert_no_leak(engine)


@pytest.mark.parametrize("ignore_eos", [False, True])
@pytest.mark.parametrize(
    ("grammar", "text"),
    [(DEAD_AFTER_X, "x"), (DEAD_AT_START, "")],
    ids=["dead-after-x", "dead-at-start"],
)
def test_grammar_that_allows_no_token_ends_its_request_with_eos(
    model_dir: Path,
    expected: dict[str, RequestOutput],
    grammar: str,
    text: str,
    ignore_eos: bool,
) -> None:
    engine = small_engine(model_dir)
    eos = engine.tokenizer.eos_token_id
    assert eos is not None
    _add_all(engine, override={"r1": S(grammar=grammar)}, ignore_eos=ignore_eos)
    got = _drain(engine)
    r1 = got["r1"].outputs[0]
    # Ends at once, on EOS (the only token allowed), even with ignore_eos: no garbage tokens
    # and no run to max_tokens.
    assert got["r1"].error is None and r1.finish_reason == "stop"
    x_ids = engine.tokenizer.encode(text, add_special_tokens=False) if text else []
    assert r1.token_ids == [*x_ids, eos]
    if not ignore_eos:  # (ignore_eos changes the other requests' outputs)
        for rid, out in expected.items():
            assert _tokens(got[rid]) == _tokens(out), rid
    assert all(got[rid].error is None for rid in SPECS)
    assert engine.structured.stats.num_faults == 0
    _assert_no_leak(engine)


class OutOfFuelAfter:
    """The real matcher until its ``after``-th mask, then stopped by a limit of the grammar
    engine (in an error state and stopped, as llguidance's is when its lexer runs out of
    fuel mid-generation)."""

    def __init__(self, real: Any, after: int) -> None:
        self.real, self.after = real, after
        self.num_masks = 0
        self.out = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def unsafe_compute_mask_ptr(self, ptr: int, nbytes: int) -> None:
        self.num_masks += 1
        self.real.unsafe_compute_mask_ptr(ptr, nbytes)
        self.out = self.out or self.num_masks >= self.after

    def is_error(self) -> bool:
        return self.out or bool(self.real.is_error())

    def is_stopped(self) -> bool:
        return self.out or bool(self.real.is_stopped())

    def get_error(self) -> str:
        return "lexer error: too many expressions constructed" if self.out else ""


def test_a_matcher_out_of_a_limit_mid_generation_fails_its_request_not_stop(
    model_dir: Path, expected: dict[str, RequestOutput]
) -> None:
    engine = small_engine(model_dir)
    _add_all(engine)
    state = engine.structured._states["r1"]
    state.matcher = OutOfFuelAfter(state.matcher, after=2)
    got = _drain(engine)
    r1 = got["r1"]
    assert r1.error is not None and "lexer fuel" in r1.error, r1.error
    # Finish reason "error" (vLLM's FinishReason.ERROR) with the text so far, never "stop".
    c = r1.outputs[0]
    assert c.finish_reason == "error" and r1.failed_with_output
    assert len(c.token_ids) >= 1 and c.text == engine.tokenizer.decode(c.token_ids)
    for rid, out in expected.items():
        assert got[rid].error is None and _tokens(got[rid]) == _tokens(out), rid
    _assert_no_leak(engine)


def test_a_limit_mid_generation_is_a_200_with_finish_error_or_an_error_event(
    model_dir: Path,
) -> None:
    """Through the OpenAI server: not streamed, a 200 whose choice has finish reason "error"
    and the text generated so far; streamed, an error event before ``[DONE]``. A request
    without a constraint is served as usual."""
    engine = small_engine(model_dir)
    structured = engine.structured
    real_add = structured.add_request

    def add_out_of_fuel(request_ids: list[str], spec: S) -> None:
        real_add(request_ids, spec)
        for rid in request_ids:
            state = structured._states[rid]
            state.matcher = OutOfFuelAfter(state.matcher, after=3)

    structured.add_request = add_out_of_fuel  # type: ignore[method-assign]
    body = {"prompt": "hello", "max_tokens": 8, "temperature": 0.0,
            "structured_outputs": {"regex": "[a-z]{2,12}"}}  # fmt: skip

    async def main() -> None:
        app = build_app(engine)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "error" and choice["text"], choice
            assert re.fullmatch("[a-z]{1,12}", choice["text"]), choice
            assert r.json()["usage"]["completion_tokens"] >= 1
            streamed = await c.post("/v1/completions", json={**body, "stream": True})
            events = [ln[6:] for ln in streamed.text.splitlines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert err["code"] == "request_failed" and "lexer fuel" in err["message"], err
            finishes = [json.loads(e)["choices"][0].get("finish_reason") for e in events[:-2]]
            assert all(f is None for f in finishes), finishes
            chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                    "temperature": 0.0, "structured_outputs": {"regex": "[a-z]{2,12}"}}  # fmt: skip
            r = await c.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "error", choice
            assert re.fullmatch("[a-z]{1,12}", choice["message"]["content"]), choice
            ok = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        await app.state.async_engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), timeout=120))
