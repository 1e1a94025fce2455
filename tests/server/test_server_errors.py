"""The one map from engine exceptions to HTTP status (``errors.ENGINE_ERRORS``), pinned:
every entry, raised at admission or under a running request, gives the status and code the
map names on every generating route (JSON and SSE); a dead engine is a 503 on every route
that reaches the engine; anything the map does not name is a 500 that hides its text."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from kvserve.engine.async_engine import EngineDeadError, QueueFullError, RequestFailedError
from kvserve.server.app import build_app
from kvserve.server.errors import ENGINE_ERRORS, ErrorStatus
from tests.server.fake_engine import FakeEngine

# (path, body) of every route that queues engine requests; each in JSON and SSE.
GENERATING = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 200}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 150}),
]
ROUTES = [
    (path, {**body, "stream": stream}) for path, body in GENERATING for stream in (False, True)
]
ENTRIES = sorted(ENGINE_ERRORS.items(), key=lambda kv: kv[0].__name__)


def test_the_map_covers_the_engine_exceptions_with_the_agreed_statuses() -> None:
    # overloaded / dead / draining: 503; the request's own input: 400; a failure of the
    # engine under one request: 500.
    assert {cls: e.status_code for cls, e in ENGINE_ERRORS.items()} == {
        QueueFullError: 503,
        EngineDeadError: 503,
        RequestFailedError: 500,
        ValueError: 400,
    }


def _run(check: Callable[[httpx.AsyncClient, FakeEngine, Any], Awaitable[None]]) -> None:
    async def main() -> None:
        fake = FakeEngine(max_model_len=256, step_seconds=0.05)
        app = build_app(fake, debug_endpoints=True)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await check(client, fake, app)
        await app.state.async_engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), timeout=120))


def _check_error(resp: httpx.Response, want: ErrorStatus, stream: bool) -> dict[str, Any]:
    """The error of ``resp``: its HTTP status, or, for a stream that had started, the error
    event before ``[DONE]`` (the status is 200 by then)."""
    if stream and resp.status_code == 200:
        events = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]", events
        err = json.loads(events[-2])["error"]
    else:
        assert resp.status_code == want.status_code, resp.text
        err = resp.json()["error"]
        if want.status_code == 503:
            assert resp.headers["retry-after"]
    assert err["code"] == want.code, err
    assert err["type"] == ("invalid_request_error" if want.status_code < 500 else "server_error")
    return err


@pytest.mark.parametrize("cls,want", ENTRIES, ids=[cls.__name__ for cls, _ in ENTRIES])
def test_an_exception_at_admission_gets_its_status_on_every_route(
    cls: type[Exception], want: ErrorStatus
) -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine, app: Any) -> None:
        for path, body in ROUTES:
            fake.fail_add_with = cls(f"injected {cls.__name__}")
            r = await c.post(path, json=body)
            assert r.status_code == want.status_code, (path, body, r.text)
            err = _check_error(r, want, stream=False)
            assert f"injected {cls.__name__}" in err["message"]
        fake.fail_add_with = None
        assert (await c.get("/health")).status_code == 200

    _run(check)


@pytest.mark.parametrize("cls,want", ENTRIES, ids=[cls.__name__ for cls, _ in ENTRIES])
def test_an_exception_under_a_running_request_gets_its_status_on_every_route(
    cls: type[Exception], want: ErrorStatus
) -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine, app: Any) -> None:
        engine = app.state.async_engine
        for path, body in ROUTES:
            request = asyncio.ensure_future(c.post(path, json=body))
            while engine.num_unfinished == 0:  # the request runs (200 tokens: 10 s)
                assert not request.done(), request.result().text
                await asyncio.sleep(0.005)
            assert engine.fail_all_requests(cls(f"injected {cls.__name__}")) == 1
            r = await request
            err = _check_error(r, want, stream=bool(body["stream"]))
            assert f"injected {cls.__name__}" in err["message"]
            assert (r.status_code == 200) == bool(body["stream"])

    _run(check)


def test_a_dead_engine_is_a_503_on_every_route_that_reaches_it() -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine, app: Any) -> None:
        fake.fail_next_step = True
        await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert app.state.async_engine.is_dead
        want = ENGINE_ERRORS[EngineDeadError]
        calls = [
            *(("POST", path, body) for path, body in ROUTES),
            ("POST", "/tokenize", {"prompt": "hi"}),
            ("POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
            ("POST", "/detokenize", {"tokens": [104, 105]}),
            ("GET", "/debug/integrity", None),
        ]
        for method, path, body in calls:
            r = await c.request(method, path, json=body)
            assert r.status_code == 503, (path, r.text)
            _check_error(r, want, stream=False)
        assert (await c.get("/health")).status_code == 503

    _run(check)


def test_an_exception_the_map_does_not_name_is_a_500_without_its_text() -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine, app: Any) -> None:
        engine = app.state.async_engine
        for path, body in ROUTES:
            fake.fail_add_with = KeyError("secret-detail")
            r = await c.post(path, json=body)
            assert r.status_code == 500 and "secret-detail" not in r.text
            assert "KeyError" in r.json()["error"]["message"]
            fake.fail_add_with = None
            request = asyncio.ensure_future(c.post(path, json=body))
            while engine.num_unfinished == 0:
                assert not request.done(), request.result().text
                await asyncio.sleep(0.005)
            engine.fail_all_requests(KeyError("secret-detail"))
            r = await request
            assert "secret-detail" not in r.text and "KeyError" in r.text
            if body["stream"]:
                assert r.text.endswith("data: [DONE]\n\n")
            else:
                assert r.status_code == 500

    _run(check)
