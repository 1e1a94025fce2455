"""``SpeculativeConfig``: speculative decoding's options, as vLLM's ``speculative_config``.

Given to ``LLM(speculative_config={...})`` / ``EngineConfig`` as a dict (vLLM's form), a JSON
string (``--speculative-config '{"method": "ngram", ...}'``) or this dataclass. Two methods:

- ``ngram`` (prompt lookup, vLLM's ``method: "ngram"``): the last ``n`` tokens of a request
  (``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked up earlier in its prompt
  and output; the tokens that followed the latest match are the draft.
- ``draft_model`` (vLLM's ``{"model": PATH, ...}``): a second, smaller model sharing the
  target's tokenizer proposes the draft greedily (see docs/speculative.md for its state).

Torch-free: the scheduler (core/) reads it. Validation raises ValueError naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SPEC_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16

# NOTE: the price of one more token in a request's verification chunk, as a fraction of a
# one-token decode step at batch 1, before the engine has measured it on this machine
# (core/sched/draft_price.py: 0.27 on a Zen 3 EPYC, about 0.07 on a Zen 4; docs/speculative.md)
# and a draft model's verification part (engine/draft_model.py) ...
DEFAULT_DRAFT_TOKEN_COST = 0.15
# ... and at this many running requests a step's extra tokens cost as much as decodes of
# their own (the step is compute-bound), so speculation cannot pay (vLLM's
# ``disable_by_batch_size``).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding options (vLLM's names where vLLM has the option).

    ``num_speculative_tokens``: the most draft tokens a request verifies per step (1..16).
    ``prompt_lookup_max`` / ``prompt_lookup_min``: n-gram lengths tried, longest first; as
    vLLM, one given alone sets both (neither given: 3 down to 1, see the NOTE below).
    ``model``: the draft model (method ``draft_model``).
    ``disable_by_batch_size``: no speculation in a step with at least this many running
    requests (vLLM's option; None: ``DEFAULT_DISABLE_BY_BATCH_SIZE``).
    ``draft_token_cost``: the cost model's price of one verified draft token, as a fraction
    of a one-token decode step at batch 1 (kvserve's; see ``core/sched/speculate.py``);
    None: for n-gram, measured from the engine's one-request steps
    (``core/sched/draft_price.py``, ``DEFAULT_DRAFT_TOKEN_COST`` until measured); for a draft
    model, derived from the two models (``engine/draft_model.py``).
    ``adaptive``: size each request's draft by its measured acceptance (kvserve's; False:
    always the longest draft the proposer finds, up to ``num_speculative_tokens``).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None
    draft_token_cost: float | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPEC_METHODS)}, "
                f"got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                "speculative_config.num_speculative_tokens must be an int in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        # NOTE: vLLM's rule: one of the two alone sets both. With neither, vLLM takes 5 and
        # 5; kvserve takes 3 down to 1, since a small model's copies are often short.
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if hi is None and lo is None:
            lo, hi = 1, 3
        elif hi is None:
            hi = lo
        elif lo is None:
            lo = hi
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an int >= 1, got {value!r}")
        if lo > hi:  # type: ignore[operator]
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model (the draft model's path) is required")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model is for method 'draft_model', not 'ngram'")
        b = self.disable_by_batch_size
        if b is None:
            object.__setattr__(self, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        elif not _is_int(b) or b < 1:
            raise ValueError(
                f"speculative_config.disable_by_batch_size must be an int >= 1, got {b!r}"
            )
        # NOTE: None stays None: measured (n-gram), or set by the engine (a draft model).
        c = self.draft_token_cost
        if c is not None and (
            isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c <= 1.0
        ):
            raise ValueError(
                f"speculative_config.draft_token_cost must be a number in [0, 1], got {c!r}"
            )
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be a bool, got {self.adaptive!r}")

    def __str__(self) -> str:
        """The config as the JSON ``--speculative-config`` takes (replicas get it so)."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def parse(cls, value: object) -> SpeculativeConfig | None:
        """None, a ``SpeculativeConfig``, a dict (vLLM's form) or its JSON text -> the config.

        A dict with ``model`` and no ``method`` is a draft model (as vLLM infers it); an
        unknown key is a ValueError naming it.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative_config must be a dict (or its JSON), got {type(value).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(sorted(known))}"
            )
        args: dict[str, Any] = dict(value)
        if "method" not in args and args.get("model") is not None:
            args["method"] = "draft_model"
        return cls(**args)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
