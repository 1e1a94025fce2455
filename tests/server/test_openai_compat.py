"""What an OpenAI / vLLM client sends that the server must take as they do, in process on a
fake engine: ``null`` for unset fields, streamed logprob offsets, the chosen token among the
legacy ``top_logprobs``, the JSON checks on every route, the media type, text-only content
parts, CORS and ``/version``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

import kvserve
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.server.app import build_app
from kvserve.server.metrics import ServerMetrics
from tests.server.fake_engine import FakeEngine

Check = Callable[[httpx.AsyncClient], Awaitable[None]]
CHAT = [{"role": "user", "content": "hi"}]


def _with_client(check: Check, **app_kwargs: Any) -> None:
    async def main() -> None:
        app = build_app(FakeEngine(max_model_len=64), **app_kwargs)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await check(client)
        await app.state.async_engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), timeout=60))


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def _events(text: str) -> list[dict[str, Any]]:
    lines = [ln[len("data: ") :] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "n": None, "stream": None,
                             "echo": None, "presence_penalty": None, "frequency_penalty": None,
                             "repetition_penalty": None, "min_tokens": None, "ignore_eos": None,
                             "skip_special_tokens": None, "include_stop_str_in_output": None,
                             "priority": None, "stream_options": None}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": None,
                                  "parallel_tool_calls": None, "add_generation_prompt": None,
                                  "tool_choice": None, "response_format": None}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True,
                             "stream_options": {"include_usage": None}}),
    ],
)  # fmt: skip
def test_null_means_the_default(path: str, body: dict[str, Any]) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post(path, json=body)
        assert r.status_code == 200, r.text
        if body.get("stream"):
            events = _events(r.text)
            assert all(ev.get("usage") is None for ev in events)  # include_usage: default off
            assert "".join(ev["choices"][0]["text"] for ev in events) != ""
        else:
            assert len(r.json()["choices"]) == 1  # n: default 1

    _with_client(check)


def test_null_for_a_required_field_is_still_a_400() -> None:
    async def check(c: httpx.AsyncClient) -> None:
        err = _error(await c.post("/v1/completions", json={"prompt": None}), 400)
        assert err["param"] == "prompt"
        err = _error(await c.post("/v1/chat/completions", json={"messages": None}), 400)
        assert err["param"] == "messages"

    _with_client(check)


def test_streamed_text_offsets_run_on_across_chunks() -> None:
    async def check(c: httpx.AsyncClient) -> None:
        for echo in (False, True):
            body = {"prompt": "abc", "max_tokens": 5, "logprobs": 1, "echo": echo}
            full = (await c.post("/v1/completions", json=body)).json()["choices"][0]
            r = await c.post("/v1/completions", json={**body, "stream": True})
            text, offsets, tokens = "", [], []
            for ev in _events(r.text):
                (ch,) = ev["choices"]
                offsets += ch["logprobs"]["text_offset"]
                tokens += ch["logprobs"]["tokens"]
                text += ch["text"]
            assert text == full["text"] and tokens == full["logprobs"]["tokens"]
            assert offsets == full["logprobs"]["text_offset"]
            # each offset is where its token's text starts in the choice's text
            assert all(text[o:].startswith(t) for o, t in zip(offsets, tokens, strict=True))

    _with_client(check)


def test_legacy_top_logprobs_always_hold_the_chosen_token() -> None:
    async def check(c: httpx.AsyncClient) -> None:
        body = {"prompt": "abc", "max_tokens": 3, "logprobs": 0}
        lp = (await c.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
        assert lp["top_logprobs"] == [
            {tok: tok_lp} for tok, tok_lp in zip(lp["tokens"], lp["token_logprobs"], strict=True)
        ]
        body["logprobs"] = 2
        lp = (await c.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
        assert all(
            tok in top and len(top) <= 3
            for tok, top in zip(lp["tokens"], lp["top_logprobs"], strict=True)
        )

    _with_client(check)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ('{"prompt": "x\\ud800y"}', "invalid_encoding"),
        ('{"messages": [{"role": "user", "content": "a\\udc00"}]}', "invalid_encoding"),
        ('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", "json_too_deep"),
    ],
)
def test_tokenize_gets_the_json_checks_too(body: str, code: str) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        headers = {"content-type": "application/json"}
        err = _error(await c.post("/tokenize", content=body, headers=headers), 400)
        assert err["code"] == code, err
        ok = await c.post("/tokenize", json={"prompt": "hi"})
        assert ok.status_code == 200 and ok.json()["tokens"] == [ord("h"), ord("i")]

    _with_client(check)


def test_a_body_that_is_not_json_is_a_415() -> None:
    async def check(c: httpx.AsyncClient) -> None:
        form = {"content-type": "application/x-www-form-urlencoded"}
        body = json.dumps({"prompt": "hi", "max_tokens": 2})
        err = _error(await c.post("/v1/completions", content=body, headers=form), 415)
        assert "application/json" in err["message"] and "x-www-form-urlencoded" in err["message"]
        err = _error(await c.post("/v1/completions", content=body.encode()), 415)
        assert "no Content-Type" in err["message"]
        typed = {"content-type": "application/json; charset=utf-8"}
        assert (await c.post("/v1/completions", content=body, headers=typed)).status_code == 200

    _with_client(check)


def test_a_content_part_other_than_text_is_named() -> None:
    async def check(c: httpx.AsyncClient) -> None:
        part = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
        msgs = [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, part]}]
        err = _error(await c.post("/v1/chat/completions", json={"messages": msgs}), 400)
        assert err["param"] == "messages"
        assert "'image_url'" in err["message"] and "not supported" in err["message"]
        assert "Extra inputs" not in err["message"]
        msgs[0]["content"] = [{"type": "text", "text": "what is it?"}]
        ok = await c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
        assert ok.status_code == 200

    _with_client(check)


def test_two_output_constraints_name_the_second() -> None:
    async def check(c: httpx.AsyncClient) -> None:
        body = {
            "messages": CHAT,
            "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "[a-z]+"},
        }
        err = _error(await c.post("/v1/chat/completions", json=body), 400)
        assert err["param"] == "structured_outputs", err
        assert "response_format and structured_outputs" in err["message"]

    _with_client(check)


def test_cors_only_for_the_allowed_origins_and_before_the_key() -> None:
    preflight = {
        "origin": "http://localhost:3000",
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }

    async def allowed(c: httpx.AsyncClient) -> None:
        r = await c.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        body = {"messages": CHAT, "max_tokens": 2}
        headers = {"origin": "http://localhost:3000", "authorization": "Bearer k"}
        r = await c.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = await c.options(
            "/v1/chat/completions", headers={**preflight, "origin": "http://evil"}
        )
        assert "access-control-allow-origin" not in other.headers

    async def none(c: httpx.AsyncClient) -> None:
        r = await c.options("/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers

    _with_client(allowed, api_key="k", allowed_origins=["http://localhost:3000"])
    _with_client(none)


def test_version() -> None:
    async def check(c: httpx.AsyncClient) -> None:
        r = await c.get("/version")
        assert r.status_code == 200 and r.json() == {"version": kvserve.__version__}

    _with_client(check)


def test_ttft_is_recorded_at_the_first_token_even_if_the_request_is_aborted() -> None:
    metrics = ServerMetrics()

    def output(tokens: list[int], finished: bool) -> RequestOutput:
        done = CompletionOutput(index=0, text="", token_ids=tokens, delta_token_ids=tokens[-1:])
        m = RequestMetrics(
            arrival_time=0.0, queue_time=0.01, ttft=0.2, e2e=1.0 if finished else None
        )
        return RequestOutput("r", None, [1], [done], finished=finished, metrics=m)

    def count(name: str) -> float:
        page = metrics.render().decode()
        line = next(ln for ln in page.splitlines() if ln.startswith(f"kvserve:{name}_count"))
        return float(line.split()[-1])

    metrics.on_output(output([5], finished=False))
    metrics.on_output(output([5, 6], finished=False))
    metrics.on_request_done("r")  # aborted: no final output
    assert count("time_to_first_token_seconds") == 1
    assert count("request_queue_time_seconds") == 1
    assert count("e2e_request_latency_seconds") == 0
    assert count("inter_token_latency_seconds") == 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "abc", "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4}),
    ],
)
def test_continuous_usage_stats(path: str, body: dict[str, Any]) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        options = {"include_usage": True, "continuous_usage_stats": True}
        r = await c.post(path, json={**body, "stream": True, "stream_options": options})
        events = _events(r.text)
        final = events[-1]["usage"]
        counts = [ev["usage"]["completion_tokens"] for ev in events[:-1] if ev.get("usage")]
        assert counts[-4:] == [1, 2, 3, 4] and final["completion_tokens"] == 4
        assert all(
            ev["usage"]["prompt_tokens"] == final["prompt_tokens"] for ev in events if ev["usage"]
        )
        plain = await c.post(path, json={**body, "stream": True})
        assert all(ev.get("usage") is None for ev in _events(plain.text))

    _with_client(check)
