"""GrammarCompiler: StructuredOutputsParams -> a compiled llguidance matcher, cached.

llguidance compiles a grammar when an ``LLMatcher`` is built (lexer and parser tables are
then built lazily as masks are computed). The cache keeps one fresh matcher per distinct
constraint (LRU, bounded); every request gets a ``deep_copy()`` of it, which costs
microseconds and shares the compiled grammar. A constraint whose first masks run out of the
grammar engine's limits (limits.py) is refused with a ValueError naming the limit.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from kvserve.structured.closed_schema import closed_schema
from kvserve.structured.limits import PARSER_LIMITS, check_ref_cycles, probe
from kvserve.structured.spec import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 256

# NOTE: as vLLM's default backend, JSON may have whitespace between its tokens (a model
# writes JSON as it learned to); ``compact_json`` (vLLM's disable_any_whitespace) forbids it:
# fewer tokens, and a small model cannot emit newlines until max_tokens.
_JSON_OPTIONS = {"whitespace_flexible": True}
_COMPACT_JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(slots=True)
class CompilerStats:
    """Cache figures: compiles (misses), hits, and seconds spent compiling."""

    num_compiled: int = 0
    num_cache_hits: int = 0
    compile_seconds: float = 0.0
    last_compile_seconds: float = 0.0


class GrammarCompiler:
    """Compiles constraints for one tokenizer (vocabulary of ``vocab_size`` logits columns).

    Args:
        hf_tokenizer: the model's fast Hugging Face tokenizer.
        vocab_size: logits columns (the bitmask covers them all).
        eos_token_id: the token that ends a grammar's output.
        cache_size: distinct constraints kept compiled (least recently used dropped first).
        compact_json: JSON without whitespace between its tokens (default: any allowed).
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_id: int | None,
        cache_size: int = DEFAULT_CACHE_SIZE,
        *,
        compact_json: bool = False,
    ) -> None:
        if cache_size < 1:
            raise ValueError(f"GrammarCompiler.cache_size must be >= 1, got {cache_size}")
        import llguidance.hf

        # NOTE: ~0.5 s for a 49k vocabulary; done once per engine, on the first constraint.
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token_id
        )
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.compact_json = compact_json
        self.stats = CompilerStats()
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._cache)

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for ``spec`` (the caller owns it). Raises ValueError naming the
        problem when the schema, regex or grammar is invalid."""
        key = spec.key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.stats.num_cache_hits += 1
                return template.deep_copy()
        t0 = time.perf_counter()
        grammar = _to_grammar(spec, self.compact_json)
        template = llguidance.LLMatcher(
            self.ll_tokenizer, grammar, log_level=0, limits=PARSER_LIMITS
        )
        if template.is_error():
            message = _first_lines(template.get_error())
            raise ValueError(f"structured_outputs.{spec.kind}: {message}")
        # NOTE: llguidance builds its lexer lazily: a constraint beyond its limits compiles,
        # then fails computing its first masks; found here, it is refused at admission.
        over_limit = probe(template, self.vocab_size)
        if over_limit is not None:
            raise ValueError(f"structured_outputs.{spec.kind}: {over_limit}")
        elapsed = time.perf_counter() - t0
        with self._lock:
            self.stats.num_compiled += 1
            self.stats.compile_seconds += elapsed
            self.stats.last_compile_seconds = elapsed
            self._cache[key] = template
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return template.deep_copy()


def _to_grammar(spec: StructuredOutputsParams, compact_json: bool = False) -> str:
    """The llguidance grammar text of ``spec`` (JSON compact with ``compact_json``);
    ValueError for what cannot be converted."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        check_ref_cycles(spec.json_schema)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(closed_schema(spec.json_schema)),
                defaults=_COMPACT_JSON_OPTIONS if compact_json else _JSON_OPTIONS,
            )
        except ValueError as e:
            raise ValueError(f"structured_outputs.{kind}: invalid JSON schema: {e}") from e
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(str(spec.regex))
    if kind == "choice":
        # NOTE: JSON string escapes are valid Lark string literals.
        alternatives = " | ".join(json.dumps(c) for c in spec.choice or ())
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    try:
        lark = any_to_lark(str(spec.grammar))  # GBNF (``::=`` rules) is converted; Lark kept
    except Exception as e:  # noqa: BLE001 - the converter raises assorted errors on bad input
        raise ValueError(f"structured_outputs.grammar: cannot parse the grammar: {e}") from e
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _first_lines(message: str, num_lines: int = 6) -> str:
    """The head of an llguidance error (they end with a dump of the parser state)."""
    return "\n".join(message.strip().splitlines()[:num_lines])
