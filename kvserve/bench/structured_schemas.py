"""JSON schemas for the structured-output benchmark and tests.

Strings and arrays are bounded (maxLength / maxItems) and integers ranged, so a valid
object always fits in the benchmark's max_tokens: the validity check then measures the
engine, not a small model's tendency to write long strings.
"""

from __future__ import annotations

from typing import Any


def _string(max_len: int = 24) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_len}


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _obj({"name": _string(), "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "weather": _obj(
        {
            "city": _string(),
            "temperature_c": {"type": "integer", "minimum": -60, "maximum": 60},
            "conditions": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
        }
    ),
    "todo": _obj(
        {
            "title": _string(),
            "items": {"type": "array", "items": _string(16), "minItems": 1, "maxItems": 3},
        }
    ),
    "book": _obj(
        {
            "title": _string(),
            "author": _string(),
            "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
        }
    ),
    "place": _obj(
        {
            "name": _string(),
            "open": {"type": "boolean"},
            "location": _obj(
                {
                    "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                    "lon": {"type": "integer", "minimum": -180, "maximum": 180},
                }
            ),
        }
    ),
}

PROMPTS: dict[str, str] = {
    "person": "Describe a fictional person as JSON.",
    "weather": "Report today's weather in a city of your choice as JSON.",
    "todo": "Write a short to-do list as JSON.",
    "book": "Name a famous book as JSON.",
    "place": "Describe a cafe as JSON.",
}

# The overhead benchmark's schema: 10 fields of mixed types.
TEN_FIELDS: dict[str, Any] = _obj(
    {
        f"field_{i}": [
            _string(12),
            {"type": "integer", "minimum": 0, "maximum": 999},
            {"type": "boolean"},
            {"enum": ["red", "green", "blue"]},
        ][i % 4]
        for i in range(10)
    }
)
