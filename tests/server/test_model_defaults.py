"""The server on a fake engine: the model's sampling defaults (``--generation-config``) fill
the fields a request leaves out, the request's own values win, and OpenAI's defaults stay
where the model has none; ``--served-model-name`` is the id of /v1/models and responses."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from kvserve.models.generation_config import GenerationDefaults
from kvserve.sampling_params import SamplingParams
from kvserve.server.app import build_app
from tests.server.fake_engine import FakeEngine

MODEL_DEFAULTS = {
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.05,
    "max_tokens": 5,
}
Check = Callable[[httpx.AsyncClient, list[SamplingParams]], Awaitable[None]]


def _serve(check: Check, defaults: dict[str, Any], **app_kwargs: Any) -> None:
    """Run ``check`` against an app whose engine records the SamplingParams it is given."""

    async def main() -> None:
        fake = FakeEngine(max_model_len=64)
        fake.generation_defaults = GenerationDefaults(defaults, "generation_config.json")
        seen: list[SamplingParams] = []
        add_request = fake.add_request

        def recording_add_request(prompt: Any, params: SamplingParams, **kw: Any) -> str:
            seen.append(params)
            return add_request(prompt, params, **kw)

        fake.add_request = recording_add_request  # type: ignore[method-assign]
        app = build_app(fake, **app_kwargs)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await check(client, seen)
        await app.state.async_engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), timeout=60))


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def _knobs(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in MODEL_DEFAULTS}


def test_model_defaults_fill_what_a_request_leaves_out() -> None:
    async def check(c: httpx.AsyncClient, seen: list[SamplingParams]) -> None:
        assert (await c.post("/v1/chat/completions", json=_chat())).status_code == 200
        assert _knobs(seen[-1]) == MODEL_DEFAULTS
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": None})
        assert r.status_code == 200
        assert _knobs(seen[-1]) == MODEL_DEFAULTS  # OpenAI's 16, capped at the model's 5
        own = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
        own |= {"repetition_penalty": 1.0, "max_tokens": 9}
        assert (await c.post("/v1/chat/completions", json=_chat(**own))).status_code == 200
        assert _knobs(seen[-1]) == own  # the request's values win, OpenAI's spelled out too
        r = await c.post("/v1/chat/completions", json=_chat(max_completion_tokens=12))
        assert r.status_code == 200 and seen[-1].max_tokens == 12

    _serve(check, MODEL_DEFAULTS)


def test_without_model_defaults_openai_defaults_stay() -> None:
    async def check(c: httpx.AsyncClient, seen: list[SamplingParams]) -> None:
        assert (await c.post("/v1/chat/completions", json=_chat())).status_code == 200
        params = seen[-1]
        assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, -1, 0.0)
        assert params.repetition_penalty == 1.0
        assert params.max_tokens > MODEL_DEFAULTS["max_tokens"]  # the context's room, uncapped

        r = await c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 200 and seen[-1].max_tokens == 16  # OpenAI's default

    _serve(check, {})


def test_served_model_name_is_the_id_everywhere() -> None:
    async def check(c: httpx.AsyncClient, seen: list[SamplingParams]) -> None:
        models = (await c.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["smol"]
        assert (await c.get("/v1/models/smol")).status_code == 200
        assert (await c.get("/v1/models/fake-model")).status_code == 404
        chat = await c.post("/v1/chat/completions", json=_chat(model="smol", max_tokens=2))
        assert chat.status_code == 200 and chat.json()["model"] == "smol"
        body = {"prompt": "hi", "max_tokens": 2, "stream": True}
        stream = await c.post("/v1/completions", json=body)
        chunks = [line for line in stream.text.splitlines() if line.startswith("data: {")]
        assert chunks and all('"model":"smol"' in line for line in chunks)
        other = await c.post("/v1/completions", json={"prompt": "hi", "model": "fake-model"})
        assert other.status_code == 404 and "'smol'" in other.json()["error"]["message"]

    _serve(check, {}, served_model_name="smol")
