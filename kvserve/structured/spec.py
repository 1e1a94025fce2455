"""StructuredOutputsParams: which constraint a request's output must follow (plain data).

The fields follow vLLM's ``structured_outputs`` extra: exactly one of ``json`` (a JSON
schema), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of a list of strings)
or ``grammar`` (Lark, or GBNF/EBNF with ``::=`` rules). Grammar errors are found when the
engine compiles it (``GrammarCompiler``); this class only checks shapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_FALSE_SCHEMA = "structured_outputs.json is the schema false, which nothing matches"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint. Invalid shapes raise ValueError naming the field.

    ``json`` may be given as a dict or a JSON string; it is kept as compact JSON text so that
    equal schemas share one compiled grammar. NOTE: keys keep their order: the order of
    ``properties`` is the order the fields are generated in.
    """

    json: str | dict[str, Any] | bool | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.json is False:  # NOTE: a schema, not the unset field ``given`` skips
            raise ValueError(_FALSE_SCHEMA)
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, "
                f"grammar (got {', '.join(given) or 'none'})"
            )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from e
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema object")
            if schema is True:
                # NOTE: the schema true (any JSON value) as its object form: the grammar
                # engine applies its options (compact JSON) to object schemas only.
                schema = {}
            elif schema is False:
                raise ValueError(_FALSE_SCHEMA)
            object.__setattr__(self, "json", json.dumps(schema, separators=(",", ":")))
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError("structured_outputs.grammar must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """Cache key: (kind, canonical text)."""
        kind = self.kind
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(list(self.choice or ()))
        return kind, str(getattr(self, kind))

    @property
    def json_schema(self) -> dict[str, Any] | bool | None:
        """The JSON schema (parsed) for ``json``; ``{"type": "object"}`` for json_object."""
        if self.json_object:
            return {"type": "object"}
        return None if self.json is None else json.loads(str(self.json))
