"""Tool calling against a real ``kvserve serve`` on the embedded model (the package's server),
driven by the official openai client: named, required and auto tool choice, tools in the
prompt, errors, a chat template file with native tools."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.server.openai_extras.common import ASK, NAMED, TOOLS, error_of
from tests.server.server_proc import running_server

# Forces a Hermes tool call in free text, so "auto" parsing is exercised on real output.
FORCED_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}"\}\}\n'
    r"</tool_call>"
)


# ---- tools ----------------------------------------------------------------------------------


def _check_call(call: Any, name: str = "get_weather") -> dict[str, Any]:
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == name
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    return args


def _stream_calls(stream: Any) -> tuple[list[dict[str, Any]], str | None, str]:
    calls: dict[int, dict[str, Any]] = {}
    finish, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


def test_named_tool_choice_round_trip(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = dict(
        model=model, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=40
    )
    resp = client.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    args = _check_call(call)
    calls, finish, _ = _stream_calls(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == args
    # Follow-up turn: the call and its result go back; the model answers in text.
    follow = ASK + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})},
    ]
    again = client.chat.completions.create(
        model=model, messages=follow, tools=TOOLS, temperature=0, max_tokens=20
    )
    assert again.choices[0].message.content


def test_required_tool_choice(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = dict(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=60,
    )  # fmt: skip
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name in ("get_weather", "get_time")
    _check_call(call, call.function.name)
    # streamed: the call's header as soon as its name is written, then its arguments in pieces
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    pieces = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function.name == call.function.name
    assert len(pieces) > 2, pieces
    calls, finish, content = _stream_calls(iter(chunks))
    assert finish == "tool_calls" and not content and len(calls) == 1
    assert calls[0]["arguments"] == call.function.arguments
    # cut short by max_tokens: the named call with the arguments written so far
    cut = client.chat.completions.create(**{**kwargs, "max_tokens": 12}).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None
    (partial,) = cut.message.tool_calls or []
    assert call.function.arguments.startswith(partial.function.arguments)


def test_auto_tool_calls_parsed_from_text(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = dict(
        model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
        extra_body={"structured_outputs": {"regex": FORCED_CALL}},
    )  # fmt: skip
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls or []
    args = _check_call(call)
    calls, finish, content = _stream_calls(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and not content.strip()
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", args)]


def test_auto_without_a_call_is_plain_content(client: openai.OpenAI, model: str) -> None:
    resp = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["It is sunny."]}},
    )  # fmt: skip
    choice = resp.choices[0]
    assert choice.message.content == "It is sunny." and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"


def test_tools_reach_the_prompt(http: httpx.Client) -> None:
    follow = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]  # fmt: skip
    resp = http.post(
        "/tokenize", json={"messages": follow, "tools": TOOLS, "return_token_strs": True}
    )
    text = "".join(resp.json()["token_strs"])
    assert "<tools>" in text and '"get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n21 C\n</tool_response>" in text


def test_tool_choice_errors(http: httpx.Client) -> None:
    missing = {"type": "function", "function": {"name": "nope"}}
    resp = http.post(
        "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": missing}
    )
    assert "nope" in error_of(resp, "tool_choice")
    resp = http.post("/v1/chat/completions", json={"messages": ASK, "tool_choice": "required"})
    error_of(resp, "tool_choice")


def test_chat_template_file_with_native_tools() -> None:
    path = Path(__file__).parents[1] / "data" / "tool_chatml.jinja"
    with running_server("--max-model-len", "512", "--chat-template", str(path)) as url:
        with httpx.Client(base_url=url, timeout=120) as http:
            text = "".join(
                http.post(
                    "/tokenize", json={"messages": ASK, "tools": TOOLS, "return_token_strs": True}
                ).json()["token_strs"]
            )
            assert text.startswith("<|im_start|>system\n# Tools\n<tools>")
            assert '"name": "get_time"' in text or '"name":"get_time"' in text
            resp = http.post(
                "/v1/chat/completions",
                json={"messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 30,
                      "temperature": 0},
            )  # fmt: skip
            assert resp.json()["choices"][0]["finish_reason"] == "tool_calls"
