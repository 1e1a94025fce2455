"""The Hermes tool-call parser (whole and streamed), the prompt rewriting for templates
without tools, and the JSON schema of tool_choice="required"."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.server.chat_tools import ChatPlan, ToolStream
from kvserve.server.tools import (
    StreamingToolParser,
    hermes_messages,
    parse_tool_calls,
    required_calls,
    required_calls_schema,
    scan_required_calls,
    template_supports_tools,
)

TOOLS = [
    {"type": "function", "function": {"name": "a", "parameters": {"type": "object",
     "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
    {"type": "function", "function": {"name": "b"}},
]  # fmt: skip

TEXT = (
    'Let me check.<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
    '<tool_call>[{"name": "b", "arguments": {}}]</tool_call>'
)


def test_parse_whole_output() -> None:
    content, calls = parse_tool_calls(TEXT)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert len({c.id for c in calls}) == 2
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    bad = "x <tool_call>{not json}</tool_call>"
    assert parse_tool_calls(bad) == (bad, [])  # kept as content, nothing lost


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_equals_whole(step: int) -> None:
    parser = StreamingToolParser()
    content, calls = "", []
    for i in range(0, len(TEXT), step):
        c, new = parser.feed(TEXT[i : i + step])
        assert "<" not in c  # a tag prefix is never leaked as content
        content, calls = content + c, calls + new
    c, new = parser.finish()
    content, calls = content + c, calls + new
    whole_content, whole_calls = parse_tool_calls(TEXT)
    assert content == whole_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_streamed_text_between_and_after_blocks_is_content(step: int) -> None:
    # The text after a block used to be dropped from a stream (only the text before the first
    # block was sent), where the whole output's content keeps it.
    text = (
        'Sure.<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> And then\n'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>\nDone.\n'
    )
    parser = StreamingToolParser()
    content, calls = "", []
    for i in range(0, len(text), step):
        c, new = parser.feed(text[i : i + step])
        content, calls = content + c, calls + new
    c, new = parser.finish()
    content, calls = content + c, calls + new
    whole_content, whole_calls = parse_tool_calls(text)
    assert content == whole_content == "Sure. And then\n\nDone."
    assert [c.name for c in calls] == [c.name for c in whole_calls] == ["a", "b"]


def test_streamed_unclosed_block_and_plain_text() -> None:
    parser = StreamingToolParser()
    assert parser.feed('<tool_call>{"name": "a", "arguments": {"x": 2}}') == ("", [])
    content, calls = parser.finish()
    assert content == "" and [c.name for c in calls] == ["a"]
    parser = StreamingToolParser()
    assert parser.feed("a < b <tool") == ("a < b ", [])
    assert parser.finish() == ("<tool", [])


def test_hermes_messages_for_plain_templates() -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "1", "tool_call_id": "c1"},
        {"role": "tool", "content": "2", "tool_call_id": "c2"},
    ]  # fmt: skip
    out = hermes_messages(msgs, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and '"name": "a"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
    assert (
        out[3]["content"]
        == "<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>"
    )
    assert all(set(m) == {"role", "content"} for m in out)
    assert template_supports_tools("{% for tool in tools %}{% endfor %}")
    assert not template_supports_tools("{{ messages }}")


@pytest.mark.parametrize("parallel", [True, False])
def test_required_schema(parallel: bool) -> None:
    schema = required_calls_schema(TOOLS, parallel)
    one = [{"name": "a", "arguments": {"x": 3}}]
    jsonschema.validate(one, schema)
    two = one + [{"name": "b", "arguments": {}}]
    if parallel:
        jsonschema.validate(two, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "a", "arguments": {"x": "no"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    calls = required_calls(json.dumps(two))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 3}), ("b", {})]


ARGS_A = '{"x":3,"y":[1,{"z":"}\\"]"}],"w":null}'
REQUIRED = '[{"name":"a","arguments":' + ARGS_A + '},{"name":"b","arguments":{}}]'


def test_required_calls_as_written_and_cut_short() -> None:
    assert [(c.name, c.arguments) for c in required_calls(REQUIRED)] == [("a", ARGS_A), ("b", "{}")]
    spaced = json.dumps(json.loads(REQUIRED))  # whitespace between tokens: the same calls
    assert [json.loads(c.arguments) for c in required_calls(spaced)] == [json.loads(ARGS_A), {}]
    scalar = '[{"name":"c","arguments":12},{"name":"d","arguments":true}]'
    assert [c.arguments for c in required_calls(scalar)] == ["12", "true"]
    # cut short by max_tokens: the calls named so far, arguments as far as they were written
    assert [(c.name, c.arguments) for c in required_calls('[{"name": "a", "argu')] == [("a", "")]
    assert required_calls('[{"name":"a') == []
    for k in range(len(REQUIRED) + 1):
        for span, (name, args) in zip(
            scan_required_calls(REQUIRED[:k]), [("a", ARGS_A), ("b", "{}")], strict=False
        ):
            assert span.name in (None, name)
            assert args.startswith(span.arguments(REQUIRED[:k]))
            assert (span.args_end is not None) == (span.arguments(REQUIRED[:k]) == args)


@given(st.lists(st.integers(1, len(REQUIRED)), max_size=12))
def test_required_stream_sends_names_then_arguments(cuts: list[int]) -> None:
    stream = ToolStream(ChatPlan(tool_mode="required"))
    bounds = [0, *sorted(set(cuts)), len(REQUIRED)]
    deltas = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        last = hi == len(REQUIRED)
        delta, reason = stream.delta(REQUIRED[lo:hi], "stop" if last else None)
        if last:
            assert reason == "tool_calls"
        if delta is not None:
            assert delta.content is None
            deltas += delta.tool_calls or []
    headers = [d for d in deltas if d.id is not None]
    assert [(d.index, d.type, d.function.name) for d in headers] == [
        (0, "function", "a"),
        (1, "function", "b"),
    ]
    args = ["", ""]
    for d in deltas:
        args[d.index] += d.function.arguments or ""
    assert args == [ARGS_A, "{}"]
    # no argument text before its call's header
    assert all(deltas.index(h) <= min(i for i, d in enumerate(deltas) if d.index == h.index)
               for h in headers)  # fmt: skip


def test_required_stream_keeps_an_unnamed_output_as_content() -> None:
    stream = ToolStream(ChatPlan(tool_mode="required"))
    assert stream.delta('[{"na', None) == (None, None)
    delta, reason = stream.delta('me":"a', "length")
    assert delta is not None and delta.content == '[{"name":"a' and reason == "length"
