"""Structured output against a real ``kvserve serve`` on the embedded model (the package's
server), driven by the official openai client: parse, json_schema streaming, regex and choice
grammars, bad constraints, an unsatisfiable schema."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from kvserve.bench.structured_schemas import SCHEMAS
from tests.server.openai_extras.common import ASK, error_of
from tests.server.server_proc import FRESH_A, FRESH_B


class Person(BaseModel):
    name: str
    age: int


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
        ("structured_outputs", {"regex": "(.{1,1000}){1,1000}"}, "lexer fuel"),
        (
            "structured_outputs",
            {"json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#"}}}},
            "$ref cycle",
        ),
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
    assert needle in error_of(resp, field)
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
