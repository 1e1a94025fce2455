"""A client that reads an SSE stream slowly gets fewer, larger chunks with the same content,
tool-call arguments, logprobs, finish reasons and usage as a client that reads at once: the
steps it did not read merge in the request's stream (fake engine, the app driven over ASGI
with a ``send`` that lets engine steps pass before it returns, as a stalled socket does)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from kvserve.outputs import RequestOutput
from kvserve.server.app import build_app
from tests.server.fake_engine import FakeEngine

MAX_TOKENS = 30
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MSGS = [{"role": "user", "content": "weather?"}]
USAGE = {"include_usage": True, "continuous_usage_stats": True}


class CountingEngine(FakeEngine):
    """The fake engine, counting its steps (the slow client waits on them)."""

    def __init__(self) -> None:
        super().__init__(max_model_len=1024, step_seconds=0.001)
        self.num_steps = 0

    def step(self) -> list[RequestOutput]:
        outs = super().step()
        self.num_steps += 1
        return outs


async def _until(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.001)


async def _post(path: str, body: dict[str, Any], steps_per_chunk: int) -> list[dict[str, Any]]:
    """POST ``body`` to a fresh app; after each body chunk, ``send`` returns only once the
    engine has taken ``steps_per_chunk`` more steps (or has no request left). Checks the
    200 and the final ``[DONE]``; returns the other SSE events."""
    fake = CountingEngine()
    app = build_app(fake)
    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"test"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
        ],
        "client": ("127.0.0.1", 5000),
        "server": ("test", 80),
    }
    body_sent, finished = False, asyncio.Event()
    status: list[int] = []
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            goal = fake.num_steps + steps_per_chunk
            await _until(lambda: fake.num_steps >= goal or not fake.requests)

    try:
        await app(scope, receive, send)
    finally:
        finished.set()
        await app.state.async_engine.shutdown()
    text = b"".join(chunks).decode()
    assert status == [200], text
    lines = text.splitlines()
    events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _totals(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client assembles from the chunks, per choice: text, tool-call names and
    arguments, logprobs, finish reasons, the last continuous usage; and the final usage."""
    out: dict[str, Any] = {"usage": None, "choices": {}}
    for ev in events:
        if not ev["choices"]:
            out["usage"] = ev["usage"]
            continue
        (ch,) = ev["choices"]
        got = out["choices"].setdefault(
            ch["index"], {"text": "", "calls": {}, "logprobs": [], "finish": [], "usage": None}
        )
        delta = ch.get("delta", {})
        got["text"] += ch.get("text") or delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            c = got["calls"].setdefault(call["index"], {"name": None, "arguments": ""})
            if "function" in call and call["function"].get("name"):
                c["name"] = call["function"]["name"]
            c["arguments"] += (call.get("function") or {}).get("arguments") or ""
        lp = ch.get("logprobs")
        if lp is not None:
            # chat: one entry per token; completions: parallel lists, regrouped per token
            got["logprobs"] += lp.get("content") or [
                list(t)
                for t in zip(
                    lp["tokens"],
                    lp["token_logprobs"],
                    lp["top_logprobs"],
                    lp["text_offset"],
                    strict=True,
                )
            ]
        if ch.get("finish_reason") is not None:
            got["finish"].append(ch["finish_reason"])
        if ev.get("usage") is not None:
            got["usage"] = ev["usage"]
    return out


CASES = [
    (
        "/v1/chat/completions",
        {"messages": MSGS, "n": 2, "logprobs": True, "top_logprobs": 2, "seed": 3},
    ),
    (
        "/v1/chat/completions",
        {
            "messages": MSGS,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    ),  # fmt: skip
    ("/v1/completions", {"prompt": ["ab", "cd"], "n": 2, "logprobs": 2, "echo": True}),
]


@pytest.mark.parametrize(("path", "body"), CASES, ids=["chat-n2-logprobs", "tool-call", "batch"])
def test_a_slow_client_gets_the_same_response_in_fewer_chunks(
    path: str, body: dict[str, Any]
) -> None:
    body = {**body, "max_tokens": MAX_TOKENS, "stream": True, "stream_options": USAGE}

    async def main() -> tuple[Any, Any]:
        return await _post(path, body, 0), await _post(path, body, 3)

    fast, slow = asyncio.run(asyncio.wait_for(main(), 60))
    want, got = _totals(fast), _totals(slow)
    assert got == want
    num_choices = len(body.get("prompt", [""])) * body.get("n", 1)
    assert sorted(got["choices"]) == list(range(num_choices))
    assert got["usage"]["completion_tokens"] == num_choices * MAX_TOKENS
    for choice in got["choices"].values():
        assert len(choice["finish"]) == 1 and choice["usage"]["completion_tokens"] == MAX_TOKENS
        if body.get("logprobs"):
            assert len(choice["logprobs"]) == MAX_TOKENS
    if body.get("echo"):
        n = body["n"]
        for index, choice in got["choices"].items():
            prompt = body["prompt"][index // n]
            assert choice["text"].startswith(prompt) and len(choice["text"]) == len(prompt) + 30
    if "tools" in body:
        (call,) = got["choices"][0]["calls"].values()
        assert call["name"] == "get_weather" and len(call["arguments"]) == MAX_TOKENS
    # NOTE: after each chunk 3 steps pass before the next is taken: a choice's 30 tokens
    # come in at most 1 + ceil(29 / 3) chunks (one per token for a client that keeps up).
    for index in got["choices"]:
        num_chunks = sum(1 for ev in slow for ch in ev["choices"] if ch["index"] == index)
        assert num_chunks <= 1 + 1 + 10  # the role chunk of chat, then the content
