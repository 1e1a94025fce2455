"""What a constraint may cost the grammar engine, and the checks that refuse one that would
cost more, at admission rather than mid-generation.

- ``PARSER_LIMITS``: llguidance's limits, with the lexer's start-up fuel at a fifth of its
  default, so a constraint that exhausts it holds a tokenizer thread a fifth as long.
- ``probe``: the first ``PROBE_STEPS`` masks of a fresh matcher, each after consuming one
  allowed token: a constraint whose lexer or parser runs out of a limit there is refused
  (ValueError naming the limit) before any request is queued.
- ``limit_error``: whether a matcher's error is a limit (the request then fails with an
  error) rather than a grammar that allows no further token (which ends with EOS, "stop").
- ``LimitFault``: the reason the manager reports for such a request; the engine finishes it
  with finish reason "error", keeping the text generated so far.
- ``check_ref_cycles``: a JSON schema whose ``$ref`` chain comes back to itself before any
  structure matches nothing (llguidance reads it as an empty language); refused by name.
"""

from __future__ import annotations

from typing import Any

import llguidance
import numpy as np

PARSER_LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=200_000)
PROBE_STEPS = 3

# An llguidance error's first line -> the limit it reports (the names of LLParserLimits).
_LIMIT_ERRORS = (
    ("too many expressions constructed", "lexer fuel (initial_lexer_fuel, step_lexer_fuel)"),
    ("too many states", "max_lexer_states"),
    ("max_items_in_row", "max_items_in_row"),
    ("too many items", "step_max_items"),
    ("grammar size", "max_grammar_size"),
    ("limit", "a parser limit"),
)


class LimitFault(str):
    """The reason of a request whose matcher ran out of a grammar-engine limit mid-generation
    (the text of ``limit_error``): the engine finishes it with finish reason "error" and its
    text so far, rather than failing it without output as it does other grammar faults."""

    # NOTE: a str, so a fault's reason reads the same whatever its kind; only the engine's
    # finish (failures.fail_grammar_faults) looks at the type.
    __slots__ = ()


def limit_error(matcher: Any) -> str | None:
    """The message for a ``matcher`` stopped by a limit of the grammar engine (naming the
    limit), or None: no error, or one that is not a limit (a dead end of the grammar)."""
    if not matcher.is_error():
        return None
    first = (matcher.get_error().strip().splitlines() or [""])[0]
    lowered = first.lower()
    for needle, limit in _LIMIT_ERRORS:
        if needle in lowered:
            return f"the constraint exceeds the grammar engine's {limit} limit ({first})"
    return None


def probe(matcher: Any, vocab_size: int) -> str | None:
    """Run a copy of ``matcher`` for up to ``PROBE_STEPS`` masks (consuming the highest
    allowed token after each); the limit it hits (``limit_error``), or None."""
    probe_matcher = matcher.deep_copy()
    row = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    for _ in range(PROBE_STEPS):
        probe_matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        error = limit_error(probe_matcher)
        if error is not None or probe_matcher.is_error() or probe_matcher.is_stopped():
            return error
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        if len(allowed) == 0:
            return None
        probe_matcher.consume_token(int(allowed[-1]))
    return limit_error(probe_matcher)


def check_ref_cycles(schema: Any) -> None:
    """ValueError naming the cycle when a local ``$ref`` of ``schema`` leads, through
    schemas that are themselves ``$ref``s, back to one already on the chain."""
    done: set[str] = set()  # pointers whose chains are known to end
    for start_path, node in _ref_nodes(schema, "#"):
        chain = [start_path]
        while isinstance(node, dict) and isinstance(node.get("$ref"), str):
            target = node["$ref"]
            if not (target == "#" or target.startswith("#/")) or target in done:
                break
            if target in chain:
                cycle = " -> ".join([*chain, target])
                raise ValueError(
                    f"structured_outputs.json: $ref cycle {cycle}: a schema that is only a "
                    "reference to itself matches nothing"
                )
            chain.append(target)
            node = _resolve(schema, target)
        done.update(chain)


def _ref_nodes(node: Any, path: str) -> list[tuple[str, Any]]:
    """Every (JSON pointer, subschema) of ``node`` that has a ``$ref``, without recursion."""
    out: list[tuple[str, Any]] = []
    stack = [(path, node)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("$ref"), str):
                out.append((where, item))
            stack.extend((f"{where}/{_escape(str(k))}", v) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((f"{where}/{i}", v) for i, v in enumerate(item))
    return out


def _resolve(schema: Any, pointer: str) -> Any:
    """The subschema at a local JSON pointer (``#/$defs/a``); None where it is not there."""
    node = schema
    for raw in pointer[2:].split("/") if pointer != "#" else []:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")
