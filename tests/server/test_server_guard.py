"""The request guard, draining and per-request failures, in process on a fake engine."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from kvserve.server.app import build_app
from tests.server.fake_engine import FakeEngine

Check = Callable[[httpx.AsyncClient, FakeEngine, Any], Awaitable[None]]
KEY = {"Authorization": "Bearer k"}
TOO_LARGE = "json_number_too_large"


def _with_client(check: Check, **app_kwargs: Any) -> None:
    async def main() -> None:
        fake = FakeEngine(max_model_len=64)
        app = build_app(fake, **app_kwargs)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await check(client, fake, app)
        await app.state.async_engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), timeout=60))


def _error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def _raw(body: str | bytes, headers: dict[str, str] | None = None) -> dict[str, Any]:
    data = body.encode() if isinstance(body, str) else body
    return {"content": data, "headers": {"content-type": "application/json", **(headers or {})}}


def test_key_is_checked_before_the_body_and_health_metrics_stay_open() -> None:
    async def check(c: httpx.AsyncClient, _fake: FakeEngine, _app: Any) -> None:
        # Malformed JSON without the key: 401, not 400.
        _error(await c.post("/v1/completions", **_raw("{not json")), 401)
        err = _error(await c.post("/v1/completions", **_raw("{not json", KEY)), 400)
        assert err["code"] == "json_invalid"
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200
        _error(await c.get("/v1/models/fake-model"), 401)

    _with_client(check, api_key="k")


def test_protect_metrics_guards_health_and_metrics() -> None:
    async def check(c: httpx.AsyncClient, _fake: FakeEngine, _app: Any) -> None:
        _error(await c.get("/health"), 401)
        _error(await c.get("/metrics"), 401)
        assert (await c.get("/health", headers=KEY)).status_code == 200
        assert (await c.get("/metrics", headers=KEY)).status_code == 200

    _with_client(check, api_key="k", protect_metrics=True)


def test_head_health_and_model_retrieve() -> None:
    async def check(c: httpx.AsyncClient, _fake: FakeEngine, _app: Any) -> None:
        r = await c.head("/health")
        assert r.status_code == 200 and r.content == b""
        card = (await c.get("/v1/models/fake-model")).json()
        assert card["id"] == "fake-model" and card["object"] == "model"
        _error(await c.get("/v1/models/gpt-4"), 404, "model")

    _with_client(check)


def test_body_size_limit_is_413() -> None:
    async def check(c: httpx.AsyncClient, _fake: FakeEngine, _app: Any) -> None:
        big = json.dumps({"prompt": "x" * 5000, "max_tokens": 1})
        err = _error(await c.post("/v1/completions", **_raw(big)), 413)
        assert "--max-request-bytes" in err["message"] and "1024" in err["message"]

        async def chunks() -> Any:  # no Content-Length: read only up to the limit
            for _ in range(100):
                yield b"x" * 512

        r = await c.post("/v1/completions", content=chunks())
        _error(r, 413)
        ok = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200

    _with_client(check, max_request_bytes=1024)


@pytest.mark.parametrize(
    ("body", "param", "code", "words"),
    [
        ('{"prompt": "x\\ud800y", "max_tokens": 2}', "prompt", "invalid_encoding", "U+D800"),
        (
            '{"prompt": ["ok", "b\\udfffad"], "max_tokens": 2}',
            "prompt",
            "invalid_encoding",
            "prompt[1]",
        ),
        ('{"prompt": "hi", "user": "\\udc00"}', "user", "invalid_encoding", "user"),
        (b'{"prompt": "\xff\xfe", "max_tokens": 2}', None, "invalid_encoding", "UTF-8"),
        ('{"prompt": ' + "[" * 100 + "]" * 100 + "}", "prompt", "json_too_deep", "64"),
        ('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", None, "json_too_deep", "nested"),
        ('{"prompt": "hi", "max_tokens": 1' + "0" * 5000 + "}", None, TOO_LARGE, "digits"),
        ('{"prompt": "hi", "temperature": 1.' + "5" * 2000 + "}", None, TOO_LARGE, "1000"),
    ],
)  # fmt: skip
def test_bad_json_is_a_400_naming_the_problem(
    body: str | bytes, param: str | None, code: str, words: str
) -> None:
    async def check(c: httpx.AsyncClient, _fake: FakeEngine, _app: Any) -> None:
        err = _error(await c.post("/v1/completions", **_raw(body)), 400, param)
        assert err["code"] == code and words in err["message"], err
        ok = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200

    _with_client(check)


def test_chat_surrogate_names_the_message_field() -> None:
    async def check(c: httpx.AsyncClient, _fake: FakeEngine, _app: Any) -> None:
        body = '{"messages": [{"role": "user", "content": "a\\ud83db"}]}'
        err = _error(await c.post("/v1/chat/completions", **_raw(body)), 400, "messages")
        assert "messages[0].content" in err["message"]

    _with_client(check)


def test_a_failed_request_gets_500_or_an_error_event_and_others_are_served() -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine, _app: Any) -> None:
        real_add = fake.add_request

        def add(prompt: Any, params: Any = None, **kw: Any) -> str:
            rid = real_add(prompt, params, **kw)
            if prompt == fake.tokenizer.encode("boom"):
                fake.fail_request_ids.add(rid)
            return rid

        fake.add_request = add  # type: ignore[method-assign]
        err = _error(await c.post("/v1/completions", json={"prompt": "boom"}), 500)
        assert err["code"] == "request_failed" and "injected fault" in err["message"]
        r = await c.post("/v1/completions", json={"prompt": "boom", "stream": True})
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_failed"
        ok = await c.post("/v1/completions", json={"prompt": "fine", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        assert (await c.get("/health")).status_code == 200

    _with_client(check)


def _events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_draining_cuts_requests_at_the_deadline_then_answers_503() -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine, app: Any) -> None:
        fake.step_seconds = 0.05  # 60 tokens: 3 s
        lifecycle = app.state.lifecycle
        asyncio.get_running_loop().call_later(0.3, lifecycle.on_signal)  # SIGTERM
        body = {"prompt": "slow", "max_tokens": 60, "stream": True}
        events = _events((await c.post("/v1/completions", json=body)).text)
        # The deadline (0.3 s after the signal) cut the stream: an error event, then [DONE].
        assert events[-1] == "[DONE]"
        assert "shut down" in json.loads(events[-2])["error"]["message"]
        assert 1 < len(events) - 2 < 60
        assert lifecycle.num_cut_requests == 1 and lifecycle.exit_code == 0
        assert lifecycle.drain_seconds is not None and lifecycle.drain_seconds < 2.0
        assert _error(await c.get("/health"), 503)["code"] == "draining"
        new = await c.post("/v1/completions", json={"prompt": "hi"})
        assert _error(new, 503)["code"] == "draining" and new.headers["retry-after"] == "5"

    _with_client(check, shutdown_timeout=0.3)


def test_drain_waits_for_requests_that_finish_in_time() -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine, app: Any) -> None:
        fake.step_seconds = 0.02
        lifecycle = app.state.lifecycle
        asyncio.get_running_loop().call_later(0.1, lifecycle.on_signal)
        body = {"prompt": "slow", "max_tokens": 20, "stream": True}
        events = _events((await c.post("/v1/completions", json=body)).text)
        assert events[-1] == "[DONE]" and "error" not in events[-2]
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        await asyncio.sleep(0.2)
        assert lifecycle.num_cut_requests == 0 and lifecycle.drain_seconds is not None

    _with_client(check, shutdown_timeout=30)


def test_second_signal_skips_the_wait() -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine, app: Any) -> None:
        fake.step_seconds = 0.05
        lifecycle = app.state.lifecycle
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, lifecycle.on_signal)
        loop.call_later(0.4, lifecycle.on_signal)
        body = {"prompt": "slow", "max_tokens": 60, "stream": True}
        events = _events((await c.post("/v1/completions", json=body)).text)
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        assert lifecycle.drain_seconds is not None and lifecycle.drain_seconds < 2.0

    _with_client(check, shutdown_timeout=60)


def test_queue_full_503_carries_retry_after() -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine, _app: Any) -> None:
        fake.step_seconds = 0.05
        tasks = [
            asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "a", "max_tokens": 5}))
            for _ in range(4)
        ]
        codes = []
        for t in tasks:
            r = await t
            codes.append(r.status_code)
            if r.status_code == 503:
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
        assert 503 in codes and 200 in codes

    _with_client(check, max_queued_requests=1)


def test_tokenization_runs_off_the_engine_thread() -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine, _app: Any) -> None:
        threads: list[str] = []
        real_encode = fake.tokenizer.encode

        def encode(text: str, add_special_tokens: bool = True) -> list[int]:
            threads.append(threading.current_thread().name)
            return real_encode(text, add_special_tokens)

        fake.tokenizer.encode = encode  # type: ignore[method-assign]
        assert (await c.post("/v1/completions", json={"prompt": "hi"})).status_code == 200
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
        assert len(threads) == 2
        assert all(name.startswith("kvserve-tokenize") for name in threads), threads

    _with_client(check)


def test_big_body_is_checked_too() -> None:
    async def check(c: httpx.AsyncClient, _fake: FakeEngine, _app: Any) -> None:
        body = '{"prompt": "' + "a" * (300 << 10) + '\\ud800", "max_tokens": 2}'
        err = _error(await c.post("/v1/completions", **_raw(body)), 400, "prompt")
        assert err["code"] == "invalid_encoding" and f"character {300 << 10}" in err["message"]

    _with_client(check)
