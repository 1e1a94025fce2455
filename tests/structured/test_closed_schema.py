"""JSON schemas read closed (structured/closed_schema.py): an object listing its properties
admits no other key unless the schema says so, as xgrammar's strict mode reads them."""

from __future__ import annotations

import copy
import os

import pytest

from kvserve.models.loader import default_model_path
from kvserve.structured import StructuredOutputsParams as S
from kvserve.structured.closed_schema import closed_schema
from kvserve.structured.compiler import GrammarCompiler
from kvserve.tokenizer import Tokenizer

CITY = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
    "required": ["answer", "confidence"],
}


def test_objects_with_properties_are_closed_at_every_depth() -> None:
    nested = {
        "type": "object",
        "properties": {"city": CITY, "tags": {"type": "array", "items": CITY}},
        "$defs": {"c": CITY},
        "anyOf": [CITY, {"type": "string"}],
    }
    before = copy.deepcopy(nested)
    got = closed_schema(nested)
    assert nested == before  # the request's schema is not modified
    assert got["additionalProperties"] is False
    assert got["properties"]["city"]["additionalProperties"] is False
    assert got["properties"]["tags"]["items"]["additionalProperties"] is False
    assert got["$defs"]["c"]["additionalProperties"] is False
    assert (
        got["anyOf"][0]["additionalProperties"] is False
        and "additionalProperties" not in (got["anyOf"][1])
    )


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object"},  # json_object: any object, no properties listed
        {**CITY, "additionalProperties": True},
        {**CITY, "additionalProperties": {"type": "integer"}},
        {**CITY, "patternProperties": {"^x_": {"type": "string"}}},
    ],
)
def test_a_schema_that_chose_keeps_its_choice(schema: dict) -> None:
    got = closed_schema(schema)
    assert got.get("additionalProperties", "unset") == schema.get("additionalProperties", "unset")


def test_the_compiled_grammar_refuses_a_key_the_schema_does_not_list() -> None:
    path = default_model_path()
    tok = Tokenizer.from_loaded(os.path.dirname(path), os.path.basename(path))
    compiler = GrammarCompiler(tok.hf_tokenizer, 49152, tok.eos_token_id)

    def accepted(text: str) -> bool:
        ids = tok.encode(text, add_special_tokens=False)
        return compiler.compile(S(json=CITY)).validate_tokens(ids) == len(ids)

    assert accepted('{"answer": "Tokyo", "confidence": 0.9}')
    assert not accepted('{"answer": "Tokyo", "confidence": 0.9, "country": "Japan"}')
    assert not accepted('{"answer": "Tokyo", "language": "ja"')
