"""User-facing sampling parameters, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvserve.structured.spec import StructuredOutputsParams

MAX_LOGPROBS = 20
# NOTE: bounds that keep float32 sampling finite. A penalty divides or multiplies logits, and
# temperature divides them: with |logit| <= 1e30 every result stays below float32's 3.4e38
# inside these bounds, while 1e-40 (below float32's smallest normal number) turned a row into
# inf / NaN and drew an id outside the vocabulary. Nobody samples usefully beyond them.
MIN_REPETITION_PENALTY = 1e-6
MAX_REPETITION_PENALTY = 1e6
MAX_TEMPERATURE = 1e6
MAX_LOGIT_BIAS = 100.0  # |bias| bound, as OpenAI


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the tokens of one request (OpenAI / vLLM semantics).

    Invalid values raise ``ValueError`` naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    # -1 (or 0) disables top-k; a value above the vocabulary size is clipped to it (no
    # restriction), as vLLM.
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the model's context length
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # number of top logprobs per output token (0 = chosen only)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    extra_stop: tuple[str, ...] = field(default=(), repr=False)
    # Constrained decoding (JSON schema, regex, choice, grammar); see kvserve.structured.
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> value added to its logit before sampling (ids checked against the
    # vocabulary when the request is added).
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        elif isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", list(self.stop))
        if isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))
        _check(_int(self.n) and 1 <= self.n <= 128, "n", "must be an int in [1, 128]")
        _check(
            _num(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
            "temperature",
            f"must be in [0, {MAX_TEMPERATURE:g}] (float32 sampling)",
        )
        _check(_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(_int(self.top_k) and self.top_k >= -1, "top_k", "must be -1, 0 or >= 1")
        _check(_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(self.seed is None or _int(self.seed), "seed", "must be an int or None")
        _check(
            self.max_tokens is None or (_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            "must be an int >= 1 or None",
        )
        _check(_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be an int >= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must not exceed max_tokens",
        )
        _check(
            _num(self.repetition_penalty)
            and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
            "(outside it float32 logits overflow)",
        )
        _check(
            _num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            "must be in [-2, 2]",
        )
        _check(
            _num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            "must be in [-2, 2]",
        )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(
                v is None or (_int(v) and 0 <= v <= MAX_LOGPROBS),
                name,
                f"must be None or an int in [0, {MAX_LOGPROBS}]",
            )
        if self.stop is not None:
            _check(
                isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
                "stop",
                "must be a list of non-empty strings",
            )
        if self.stop_token_ids is not None:
            _check(
                isinstance(self.stop_token_ids, list)
                and all(_int(t) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                "must be a list of non-negative ints",
            )
        _check(
            isinstance(self.extra_stop, tuple)
            and all(isinstance(s, str) and s for s in self.extra_stop),
            "extra_stop",
            "must be a tuple of non-empty strings",
        )
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "must be a StructuredOutputsParams or None",
        )
        if self.logit_bias is not None:
            _check(
                isinstance(self.logit_bias, dict)
                and all(_int(t) and t >= 0 for t in self.logit_bias)
                and all(_num(v) and abs(v) <= MAX_LOGIT_BIAS for v in self.logit_bias.values()),
                "logit_bias",
                f"must map token ids (ints >= 0) to numbers in [-{MAX_LOGIT_BIAS:g}, "
                f"{MAX_LOGIT_BIAS:g}]",
            )
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, "must be a bool")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def all_stop_strings(self) -> list[str]:
        """User stop strings plus any added by the engine (e.g. chat end markers)."""
        return list(self.stop or []) + list(self.extra_stop)


def _num(v: object) -> bool:
    """A finite real number (not a bool, NaN or infinity)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: object) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def _check(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {what}")
