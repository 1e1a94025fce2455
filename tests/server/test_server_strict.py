"""Strict where OpenAI and vLLM are strict, priority only under the priority policy, and
tokenization that no client can make the others wait for: in process on the fake engine."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from kvserve.server.app import build_app
from kvserve.server.tokenizer_pool import LARGE_JOB_BYTES
from tests.server.fake_engine import VOCAB_SIZE, FakeEngine

Check = Callable[[httpx.AsyncClient, FakeEngine], Awaitable[None]]
MSG = [{"role": "user", "content": "hi"}]


def _serve(check: Check, *, engine: dict[str, Any] | None = None, **app_kwargs: Any) -> None:
    async def main() -> None:
        fake = FakeEngine(**{"max_model_len": 64, **(engine or {})})
        app = build_app(fake, **app_kwargs)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await check(client, fake)
        await app.state.async_engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), timeout=60))


def _error(resp: httpx.Response, param: str, status: int = 400) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err: dict[str, Any] = resp.json()["error"]
    assert err["param"] == param, err
    return err


STRICT: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/chat/completions", {"messages": MSG, "stream": False,
                              "stream_options": {"include_usage": True}}, "stream_options"),
    *[("/v1/completions", {"prompt": "hi", "logit_bias": {key: 1.0}}, "logit_bias")
      for key in (" 5", "5 ", "1_0", "+3", "05", "-1", "", "٣", str(VOCAB_SIZE), "9" * 40)],
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [3, VOCAB_SIZE]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": MSG, "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": [*MSG, {"role": "tool", "content": "21 C"}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [*MSG, {"role": "tool", "content": "21 C",
                                                  "tool_call_id": ""}]}, "messages"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), STRICT)
def test_strict_fields_are_a_400_naming_them(path: str, body: dict[str, Any], param: str) -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine) -> None:
        _error(await c.post(path, json=body), param)
        assert not fake.requests and fake.num_prompt_tokens == 0  # nothing was queued

    _serve(check)


def test_their_valid_forms_are_served() -> None:
    async def check(c: httpx.AsyncClient, _fake: FakeEngine) -> None:
        ok = [
            ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {}}),
            ("/v1/completions", {"prompt": "hi", "logit_bias": {"0": 1, "42": -2, "999": 0}}),
            ("/v1/completions", {"prompt": "hi", "stop_token_ids": [0, VOCAB_SIZE - 1]}),
            ("/v1/chat/completions", {"messages": [*MSG, {"role": "tool", "content": "21 C",
                                                          "tool_call_id": "c1"}]}),
        ]  # fmt: skip
        for path, body in ok:
            r = await c.post(path, json={**body, "max_tokens": 2})
            assert r.status_code == 200, r.text

    _serve(check)


def test_priority_needs_the_priority_policy() -> None:
    body = {"prompt": "hi", "max_tokens": 2}

    async def fcfs(c: httpx.AsyncClient, _fake: FakeEngine) -> None:
        err = _error(await c.post("/v1/completions", json={**body, "priority": 1}), "priority")
        assert "--scheduling-policy priority" in err["message"]
        chat = {"messages": MSG, "priority": -3}
        _error(await c.post("/v1/chat/completions", json=chat), "priority")
        assert (await c.post("/v1/completions", json={**body, "priority": 0})).status_code == 200

    async def priority(c: httpx.AsyncClient, fake: FakeEngine) -> None:
        seen: list[int] = []
        add = fake.add_request

        def add_request(*args: Any, priority: int = 0, **kwargs: Any) -> str:
            seen.append(priority)
            return add(*args, priority=priority, **kwargs)

        fake.add_request = add_request  # type: ignore[method-assign]
        assert (await c.post("/v1/completions", json={**body, "priority": 7})).status_code == 200
        assert seen == [7]

    _serve(fcfs)
    _serve(priority, engine={"scheduling_policy": "priority"})


def test_a_text_too_long_to_fit_is_a_400_before_it_is_tokenized() -> None:
    # The fake vocabulary's longest token is 2 bytes (+1), so the bound is 64 x 4 bytes (an
    # unknown character is at most 4).
    async def check(c: httpx.AsyncClient, fake: FakeEngine) -> None:
        encoded: list[int] = []
        encode = fake.tokenizer.encode

        def counting(text: str, add_special_tokens: bool = True) -> list[int]:
            encoded.append(len(text))
            return encode(text, add_special_tokens)

        fake.tokenizer.encode = counting  # type: ignore[method-assign]
        long = "é" * 129  # 258 bytes
        err = _error(await c.post("/v1/completions", json={"prompt": ["hi", long]}), "prompt")
        assert err["code"] == "context_length_exceeded" and "256" in err["message"]
        chat = {"messages": [{"role": "user", "content": long}]}
        err = _error(await c.post("/v1/chat/completions", json=chat), "messages")
        assert err["code"] == "context_length_exceeded"
        assert encoded == []
        # Within the bound it is tokenized, and its 128 tokens do not fit: the token check.
        err = _error(await c.post("/v1/completions", json={"prompt": long[:-1]}), "prompt")
        assert err["code"] == "context_length_exceeded" and encoded == [128]

    _serve(check)


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_tokenize_endpoints_are_behind_the_key_unless_opened(path: str) -> None:
    body = {"prompt": "hi"} if path == "/tokenize" else {"tokens": [104, 105]}
    key = {"Authorization": "Bearer k"}

    async def guarded(c: httpx.AsyncClient, _fake: FakeEngine) -> None:
        assert (await c.post(path, json=body)).status_code == 401
        assert (await c.post(path, json=body, headers=key)).status_code == 200

    async def opened(c: httpx.AsyncClient, _fake: FakeEngine) -> None:
        assert (await c.post(path, json=body)).status_code == 200
        assert (await c.post("/v1/completions", json={"prompt": "hi"})).status_code == 401

    _serve(guarded, api_key="k")
    _serve(opened, api_key="k", open_tokenize_endpoints=True)


def test_a_small_request_is_not_held_behind_other_clients_big_prompts() -> None:
    """Big prompts whose tokenization does not end (a blocked tokenizer) take every thread
    they may; a small request is tokenized and served meanwhile."""
    release = threading.Event()
    big = "x" * (LARGE_JOB_BYTES + 1)

    async def check(c: httpx.AsyncClient, fake: FakeEngine) -> None:
        encode = fake.tokenizer.encode
        started: list[int] = []

        def blocking(text: str, add_special_tokens: bool = True) -> list[int]:
            if len(text) >= LARGE_JOB_BYTES:
                started.append(len(text))
                release.wait(30)
            return encode(text, add_special_tokens)

        fake.tokenizer.encode = blocking  # type: ignore[method-assign]
        wave = [
            asyncio.ensure_future(c.post("/v1/completions", json={"prompt": big})) for _ in range(6)
        ]
        try:
            while not started:
                await asyncio.sleep(0.01)
            small = await asyncio.wait_for(
                c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), timeout=20
            )
            assert small.status_code == 200, small.text
            assert not any(t.done() for t in wave)  # the big ones are still being tokenized
        finally:
            release.set()
        for r in await asyncio.gather(*wave):  # they fit in bytes, not in tokens
            assert r.json()["error"]["code"] == "context_length_exceeded"

    try:
        _serve(check, engine={"max_model_len": 8192})
    finally:
        release.set()
