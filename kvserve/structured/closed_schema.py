"""JSON schemas read closed: an object that lists its ``properties`` and says nothing of
``additionalProperties`` admits no other key.

NOTE: JSON Schema's own default admits any other key, and a small model given that freedom
never closes the object: on the embedded model, greedy, a ``json_schema`` of
``{answer, confidence}`` ran to the end of the context adding keys ("language", "country",
...; 8,155 tokens, unparseable), while the openai client's ``parse()`` (which sends
``additionalProperties: false``) got ``{"answer": "Tokyo", "confidence": 100.000}`` in 28.
xgrammar's strict mode, the default of vLLM's default backend, reads schemas the same way.
A schema that sets ``additionalProperties`` (or ``patternProperties``) keeps its choice.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is a schema, a list of schemas, or a name -> schema mapping.
_ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def closed_schema(schema: Any) -> Any:
    """A copy of ``schema`` in which every object with ``properties`` and no
    ``additionalProperties`` / ``patternProperties`` gets ``additionalProperties: false``."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = closed_schema(out[key])
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(s) for name, s in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed_schema(out["additionalProperties"])
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if "properties" in out and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    return out
