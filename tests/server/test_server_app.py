"""The FastAPI app on a fake engine, in process: schema, SSE, errors, auth, metrics, health."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from kvserve.sampling_params import SamplingParams
from kvserve.server.app import build_app, lifespan
from tests.server.fake_engine import FakeEngine

Check = Callable[[httpx.AsyncClient, FakeEngine], Awaitable[None]]


def _with_client(check: Check, **app_kwargs: Any) -> None:
    async def main() -> None:
        fake = FakeEngine(max_model_len=64)
        app = build_app(fake, **app_kwargs)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await check(client, fake)
        await app.state.async_engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), timeout=60))


def _sse_events(text: str) -> list[Any]:
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_models_and_completion_shape() -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine) -> None:
        models = (await c.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["fake-model"]
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "n": 2})
        body = r.json()
        assert r.status_code == 200 and body["object"] == "text_completion"
        assert [ch["index"] for ch in body["choices"]] == [0, 1]
        assert all(
            len(ch["text"]) == 4 and ch["finish_reason"] == "length" for ch in body["choices"]
        )
        assert body["usage"] == {
            "prompt_tokens": 2,
            "completion_tokens": 8,
            "total_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 0},
        }

    _with_client(check)


def test_batch_prompts_and_streaming_matches_non_streaming() -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine) -> None:
        req = {"prompt": ["ab", "cd"], "max_tokens": 5, "n": 2, "logprobs": 2}
        full = (await c.post("/v1/completions", json=req)).json()
        r = await c.post(
            "/v1/completions",
            json={**req, "stream": True, "stream_options": {"include_usage": True}},
        )
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r.text)
        texts: dict[int, str] = {}
        tokens: dict[int, list[str]] = {}
        for ev in events[:-1]:
            (ch,) = ev["choices"]
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            tokens.setdefault(ch["index"], []).extend(ch["logprobs"]["tokens"])
        assert {ch["index"]: ch["text"] for ch in full["choices"]} == texts
        for ch in full["choices"]:
            lp = ch["logprobs"]
            assert lp["tokens"] == tokens[ch["index"]] == list(ch["text"])
            assert all(len(top) == 2 for top in lp["top_logprobs"])
        assert events[-1]["choices"] == [] and events[-1]["usage"] == full["usage"]

    _with_client(check)


def test_chat_streaming_and_logprobs() -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine) -> None:
        msgs = [{"role": "user", "content": "hey"}]
        full = (
            await c.post(
                "/v1/chat/completions",
                json={"messages": msgs, "max_tokens": 3, "logprobs": True, "top_logprobs": 3},
            )
        ).json()
        choice = full["choices"][0]
        assert full["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
        content = choice["logprobs"]["content"]
        assert "".join(t["token"] for t in content) == choice["message"]["content"]
        assert all(len(t["top_logprobs"]) == 3 for t in content)
        r = await c.post(
            "/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "stream": True}
        )
        events = _sse_events(r.text)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
        assert text == choice["message"]["content"]
        assert events[-1]["choices"][0]["finish_reason"] == "length"

    _with_client(check)


BAD_REQUESTS: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("/v1/completions", {"prompt": "x" * 64}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x" * 50, "max_tokens": 20}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 5000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, -2]}, 400, "prompt"),
    ("/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**63}, 400, "seed"),  # -1 is a seed (vLLM)
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2.5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 2}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "a"}]}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 21, "logprobs": True},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 100},
        400,
        "max_completion_tokens",
    ),
    # A bad structured_outputs next to a good response_format used to name response_format.
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "a"}],
            "response_format": {"type": "json_object"},
            "structured_outputs": {"choice": []},
        },
        400,
        "structured_outputs",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_request_then_good_request(
    path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine) -> None:
        _assert_error(await c.post(path, json=body), status, param)
        assert not fake.requests
        ok = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) == 2

    _with_client(check)


def test_top_k_above_the_vocabulary_is_accepted() -> None:
    # vLLM clips top_k to the vocabulary (no restriction) where this was a 400.
    async def check(c: httpx.AsyncClient, fake: FakeEngine) -> None:
        seen: list[SamplingParams] = []
        real_add = fake.add_request

        def add_request(prompt: Any, params: SamplingParams | None = None, **kw: Any) -> str:
            assert params is not None
            seen.append(params)
            return real_add(prompt, params, **kw)

        fake.add_request = add_request  # type: ignore[method-assign]
        vocab = fake.arch.vocab_size
        for path, body in (
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            for top_k in (vocab + 1000, 10**6):
                r = await c.post(path, json={**body, "max_tokens": 2, "top_k": top_k})
                assert r.status_code == 200, r.text
        assert [p.top_k for p in seen] == [vocab + 1000, 10**6] * 2

    _with_client(check)


def test_malformed_json_and_unknown_route() -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine) -> None:
        r = await c.post(
            "/v1/completions",
            content=b'{"prompt": "hi",',
            headers={"content-type": "application/json"},
        )
        _assert_error(r, 400)
        json_type = {"content-type": "application/json"}
        _assert_error(await c.post("/v1/completions", content=b"[1, 2]", headers=json_type), 400)
        _assert_error(await c.get("/v1/nothing"), 404)
        assert (await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})).is_success

    _with_client(check)


def test_api_key() -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine) -> None:
        body = {"prompt": "hi", "max_tokens": 1}
        assert (await c.get("/health")).status_code == 200
        _assert_error(await c.post("/v1/completions", json=body), 401)
        bad = {"Authorization": "Bearer wrong"}
        _assert_error(await c.post("/v1/completions", json=body, headers=bad), 401)
        _assert_error(await c.get("/v1/models", headers=bad), 401)
        good = {"Authorization": "Bearer s3cret"}
        assert (await c.post("/v1/completions", json=body, headers=good)).status_code == 200

    _with_client(check, api_key="s3cret")


def test_metrics_and_dead_engine_health() -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine) -> None:
        await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        text = (await c.get("/metrics")).text
        for name in (
            "kvserve:num_requests_running",
            "kvserve:num_requests_waiting",
            "kvserve:num_requests_swapped",
            "kvserve:kv_usage",
            "kvserve:kv_utilization",
            "kvserve:prefix_cache_queries_total",
            "kvserve:prefix_cache_hits_total",
            "kvserve:num_preemptions_total",
            "kvserve:prefix_cache_evictions_total",
            "kvserve:prompt_tokens_total",
            "kvserve:generation_tokens_total",
            "kvserve:time_to_first_token_seconds_bucket",
            "kvserve:inter_token_latency_seconds_count",
            "kvserve:e2e_request_latency_seconds_sum",
            "kvserve:request_queue_time_seconds_count",
        ):
            assert f"\n{name}" in text, name
        assert "kvserve:generation_tokens_total 3.0" in text
        assert "kvserve:inter_token_latency_seconds_count 2.0" in text
        assert "kvserve:e2e_request_latency_seconds_count 1.0" in text
        assert (await c.get("/health")).status_code == 200
        fake.fail_next_step = True
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        # The loop died under the request: 503, as for a request that comes after (issue 19
        # item 5: this was a 500 while later requests got 503).
        assert _assert_error(r, 503)["code"] == "engine_dead" and r.headers["retry-after"]
        _assert_error(await c.get("/health"), 503)
        _assert_error(await c.post("/v1/completions", json={"prompt": "hi"}), 503)

    _with_client(check)


def test_debug_integrity() -> None:
    async def check(c: httpx.AsyncClient, fake: FakeEngine) -> None:
        assert (await c.get("/debug/integrity")).json() == {"ok": True}

    _with_client(check, debug_endpoints=True)

    async def hidden(c: httpx.AsyncClient, fake: FakeEngine) -> None:
        _assert_error(await c.get("/debug/integrity"), 404)

    _with_client(hidden)


def test_lifespan_freezes_start_up_objects_and_unfreezes_them_at_shutdown() -> None:
    """A full GC pass over the start-up objects stalled the step loop; the app keeps them
    out of the collector's walks while it runs, and hands them back when it stops."""

    async def main() -> None:
        app = build_app(FakeEngine(max_model_len=64))
        gc.unfreeze()
        async with lifespan(app):
            assert gc.get_freeze_count() > 1000
        assert gc.get_freeze_count() == 0

    asyncio.run(asyncio.wait_for(main(), timeout=60))
