"""Structured output, tool calling and the rest of the request surface against a real
``kvserve serve`` on the embedded model, driven by the official openai client."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from kvserve.bench.structured_schemas import SCHEMAS
from tests.server.server_proc import FRESH_A, FRESH_B, running_server

MAX_MODEL_LEN = 1024
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# Forces a Hermes tool call in free text, so "auto" parsing is exercised on real output.
FORCED_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}"\}\}\n'
    r"</tool_call>"
)


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with running_server("--max-model-len", str(MAX_MODEL_LEN), "--debug-endpoints") as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _error(resp: httpx.Response, param: str | None) -> str:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    return str(err["message"])


# ---- structured output ----------------------------------------------------------------------


def test_parse_returns_a_pydantic_object(client: openai.OpenAI, model: str) -> None:
    resp = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Describe Ann, who is 30, as JSON."}],
        response_format=Person,
        temperature=0,
        max_tokens=60,
    )
    parsed = resp.choices[0].message.parsed
    assert isinstance(parsed, Person) and resp.choices[0].finish_reason == "stop"


def test_json_schema_streaming_unchanged(client: openai.OpenAI, model: str) -> None:
    schema = {
        "type": "json_schema",
        "json_schema": {"name": "p", "schema": SCHEMAS["person"], "strict": True},
    }
    kwargs: dict[str, Any] = dict(
        model=model, messages=ASK, temperature=0, max_tokens=60, response_format=schema
    )
    full = client.chat.completions.create(extra_body=FRESH_A, **kwargs).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, extra_body=FRESH_B, **kwargs)
        if c.choices
    )
    assert streamed == full
    jsonschema.validate(json.loads(full or ""), SCHEMAS["person"])


@pytest.mark.parametrize(
    ("constraint", "pattern"),
    [
        ({"regex": "[0-9]{3}-[0-9]{4}"}, r"^[0-9]{3}-[0-9]{4}$"),
        ({"choice": ["red", "green", "blue"]}, r"^(red|green|blue)$"),
        ({"grammar": 'root ::= "<" [xyz]+ ">"'}, r"^<[xyz]+>$"),
    ],
)
def test_regex_choice_grammar_exact(
    http: httpx.Client, model: str, constraint: dict[str, Any], pattern: str
) -> None:
    for endpoint, body in [
        ("/v1/completions", {"prompt": "Answer:", "max_tokens": 16}),
        ("/v1/chat/completions", {"messages": ASK, "max_tokens": 16}),
    ]:
        resp = http.post(
            endpoint, json={**body, "model": model, "n": 3, "temperature": 1.0, "seed": 5,
                            "structured_outputs": constraint}
        )  # fmt: skip
        assert resp.status_code == 200, resp.text
        for choice in resp.json()["choices"]:
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            if choice["finish_reason"] == "stop":
                assert re.match(pattern, text), text


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("structured_outputs", {"regex": "a(b"}, "unclosed group"),
        ("structured_outputs", {"grammar": "start: foo"}, "unknown name"),
        ("structured_outputs", {"grammar": "root ::= ("}, "grammar"),
        ("structured_outputs", {"regex": "a", "choice": ["b"]}, "exactly one"),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
            "foo",
        ),
    ],
)
def test_bad_constraints_are_400_naming_the_problem(
    http: httpx.Client, field: str, value: Any, needle: str
) -> None:
    resp = http.post("/v1/chat/completions", json={"messages": ASK, field: value})
    assert needle in _error(resp, field)
    assert http.get("/debug/stats").json()["num_running"] == 0


def test_unsatisfiable_schema_ends_with_length(http: httpx.Client) -> None:
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 300}},
        "required": ["s"],
    }
    resp = http.post(
        "/v1/chat/completions",
        json={"messages": ASK, "max_tokens": 12, "temperature": 0,
              "response_format": {"type": "json_schema",
                                  "json_schema": {"name": "s", "schema": schema}}},
    )  # fmt: skip
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{")


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
    assert "nope" in _error(resp, "tool_choice")
    resp = http.post("/v1/chat/completions", json={"messages": ASK, "tool_choice": "required"})
    _error(resp, "tool_choice")


# ---- the rest of the surface ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": ASK, "foo": 1}, "foo"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x", "bar": 2}]},
            "messages",
        ),
        ("/v1/chat/completions", {"messages": ASK, "modalities": ["audio"]}, "modalities"),
        ("/v1/completions", {"prompt": "x", "foo": 1}, "foo"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"x": 1}}, "stream_options"),
        ("/tokenize", {"prompt": "x", "foo": 1}, "foo"),
    ],
)
def test_unknown_fields_are_400_naming_them(
    http: httpx.Client, endpoint: str, body: dict[str, Any], param: str
) -> None:
    message = _error(http.post(endpoint, json=body), param)
    unknown = [k for k in ("foo", "bar", "modalities", "x") if k in json.dumps(body)][-1]
    assert unknown in message


def test_logit_bias(http: httpx.Client) -> None:
    for bias, needle in [({"49152": 1}, "49152"), ({"-1": 1}, "-1"), ({"abc": 1}, "abc")]:
        resp = http.post("/v1/completions", json={"prompt": "x", "logit_bias": bias})
        assert needle in _error(resp, "logit_bias")
    resp = http.post("/v1/completions", json={"prompt": "x", "logit_bias": {"5": 101}})
    _error(resp, "logit_bias")
    target = http.post("/tokenize", json={"prompt": " banana", "add_special_tokens": False})
    tid = target.json()["tokens"][0]
    resp = http.post(
        "/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0,
              "logit_bias": {str(tid): 100}},
    )  # fmt: skip
    assert resp.json()["choices"][0]["text"] == " banana banana"


def test_echo_and_prompt_logprobs(http: httpx.Client) -> None:
    prompt = "Hello world, this is"
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1,
            "prompt_logprobs": 2}  # fmt: skip
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"].startswith(prompt)
    lp = choice["logprobs"]
    assert lp["tokens"][: len(ids)] == [
        http.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in ids
    ]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids) + 3
    prompt_lps = choice["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
    for pos in range(1, len(ids)):
        entry = prompt_lps[pos]
        assert abs(entry[str(ids[pos])]["logprob"] - lp["token_logprobs"][pos]) < 1e-6
    streamed = "".join(
        json.loads(line[6:])["choices"][0]["text"]
        for line in http.post("/v1/completions", json={**body, "stream": True}).text.splitlines()
        if line.startswith("data: {") and json.loads(line[6:])["choices"]
    )
    assert streamed == choice["text"]


def test_tokenize_detokenize(http: httpx.Client) -> None:
    resp = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert resp["count"] == len(resp["tokens"]) and resp["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": resp["tokens"]}).json() == {
        "prompt": "Hello world"
    }
    chat = http.post("/tokenize", json={"messages": ASK}).json()
    assert chat["count"] > resp["count"]
    # special tokens come back as sent (vLLM): /detokenize inverts /tokenize
    text = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>") and "<|im_end|>" in text
    assert http.post("/tokenize", json={"prompt": text}).json()["tokens"] == chat["tokens"]
    _error(http.post("/detokenize", json={"tokens": [10**6]}), "tokens")
    assert http.get("/debug/integrity").json() == {"ok": True}


def test_continue_final_message(http: httpx.Client) -> None:
    prefill = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "The capital of France is"}]  # fmt: skip
    for flags in ({}, {"add_generation_prompt": False}):
        body = {"messages": prefill, "continue_final_message": True, **flags}
        text = "".join(
            http.post("/tokenize", json={**body, "return_token_strs": True}).json()["token_strs"]
        )
        assert text.endswith("<|im_start|>assistant\nThe capital of France is"), text
        resp = http.post(
            "/v1/chat/completions", json={**body, "max_tokens": 4, "temperature": 0}
        ).json()
        assert "Paris" in resp["choices"][0]["message"]["content"], resp
    closed = http.post("/tokenize", json={"messages": prefill, "return_token_strs": True})
    assert "".join(closed.json()["token_strs"]).endswith("<|im_start|>assistant\n")
    both = {"messages": prefill, "continue_final_message": True, "add_generation_prompt": True}
    assert "both" in _error(http.post("/v1/chat/completions", json=both), "continue_final_message")
    user_last = {"messages": prefill[:1], "continue_final_message": True}
    assert "'user'" in _error(http.post("/v1/chat/completions", json=user_last), "messages")


def test_chat_echo_prepends_the_last_message_of_the_reply_role(http: httpx.Client) -> None:
    prefill = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "The capital of France is"}]  # fmt: skip
    body = {"messages": prefill, "continue_final_message": True, "max_tokens": 4,
            "temperature": 0, "n": 2}  # fmt: skip
    plain = http.post("/v1/chat/completions", json=body).json()["choices"]
    echoed = http.post("/v1/chat/completions", json={**body, "echo": True}).json()["choices"]
    for p, e in zip(plain, echoed, strict=True):
        assert e["message"]["content"] == "The capital of France is" + p["message"]["content"]
    stream = {**body, "echo": True, "stream": True}
    lines = [ln[6:] for ln in http.post("/v1/chat/completions", json=stream).text.splitlines()
             if ln.startswith("data: ") and ln != "data: [DONE]"]  # fmt: skip
    texts = ["", ""]
    for ev in map(json.loads, lines):
        for c in ev["choices"]:
            texts[c["index"]] += c["delta"].get("content") or ""
    assert texts == [e["message"]["content"] for e in echoed]
    # a new assistant turn after a user message: nothing of the reply's role to echo
    ask = {"messages": prefill[:1], "max_tokens": 4, "temperature": 0}
    assert (
        http.post("/v1/chat/completions", json={**ask, "echo": True}).json()["choices"][0]
        == http.post("/v1/chat/completions", json=ask).json()["choices"][0]
    )


def test_any_64_bit_seed_is_a_seed(http: httpx.Client) -> None:
    """Negative seeds too (vLLM takes any int64; the sampler maps every int onto its draws)."""
    for seed in (-1, -(2**63), 2**63 - 1):
        body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0,
                "seed": seed, "n": 2}  # fmt: skip
        first, again = (http.post("/v1/completions", json=body) for _ in range(2))
        assert first.status_code == 200, first.text
        assert first.json()["choices"] == again.json()["choices"]


def test_echo_with_max_tokens_0_scores_the_prompt(http: httpx.Client) -> None:
    prompt = "The capital of France is Paris."
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    full = http.post("/v1/completions", json=body).json()
    (choice,) = full["choices"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert all(x <= 0 for x in lp["token_logprobs"][1:])
    assert full["usage"]["completion_tokens"] == 0
    assert full["usage"]["total_tokens"] == full["usage"]["prompt_tokens"] == len(ids)
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    lines = [ln[6:] for ln in http.post("/v1/completions", json=stream).text.splitlines()
             if ln.startswith("data: ")]  # fmt: skip
    events = [json.loads(ln) for ln in lines[:-1]]
    assert "".join(ev["choices"][0]["text"] for ev in events if ev["choices"]) == prompt
    streamed = [t for ev in events if ev["choices"] for t in ev["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp["tokens"] and events[-1]["usage"] == full["usage"]
    no_echo = {"prompt": prompt, "max_tokens": 0}
    assert "echo" in _error(http.post("/v1/completions", json=no_echo), "max_tokens")


def test_chat_template_kwargs(http: httpx.Client) -> None:
    body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    plain = http.post("/tokenize", json={"messages": ASK}).json()["tokens"]
    assert http.post("/tokenize", json=body).json()["tokens"] == plain  # a variable it ignores
    resp = http.post("/v1/chat/completions", json={**body, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    bad = {"messages": ASK, "chat_template_kwargs": {"add_generation_prompt": False}}
    assert "'add_generation_prompt'" in _error(
        http.post("/v1/chat/completions", json=bad), "chat_template_kwargs"
    )


def test_response_format_on_completions(http: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    body = {"prompt": "A JSON object with a number n:", "max_tokens": 20, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "n", "schema": schema}}}  # fmt: skip
    text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    jsonschema.validate(json.loads(text), schema)
    both = {**body, "structured_outputs": {"regex": "[0-9]+"}}
    assert "only one" in _error(http.post("/v1/completions", json=both), "structured_outputs")


SPECIAL_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_echo_returns_the_prompt_as_sent(http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"prompt": SPECIAL_PROMPT}).json()["tokens"]
    for prompt in (SPECIAL_PROMPT, ids):
        for stream in (False, True):
            body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True,
                    "logprobs": 1, "stream": stream}  # fmt: skip
            resp = http.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            if stream:
                lines = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
                choices = [json.loads(ln)["choices"][0] for ln in lines[:-1]]
            else:
                choices = [resp.json()["choices"][0]]
            text = "".join(ch["text"] for ch in choices)
            tokens = [t for ch in choices for t in ch["logprobs"]["tokens"]]
            offsets = [o for ch in choices for o in ch["logprobs"]["text_offset"]]
            assert text.startswith(SPECIAL_PROMPT), (prompt, stream, text)
            assert len(tokens) == len(ids) + 3
            # each token's text starts at its offset (ASCII here: token texts spell the text)
            assert "".join(tokens) == text
            assert all(text[o:].startswith(t) for o, t in zip(offsets, tokens, strict=True))


def test_chat_template_file_with_native_tools() -> None:
    path = Path(__file__).parent / "data" / "tool_chatml.jinja"
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
