"""Checks of what ``LLMEngine.add_request`` is given: the prompt (text or token ids) and the
parts of SamplingParams that need the model (vocabulary, structured-output constraints)."""

from __future__ import annotations

import operator
from collections.abc import Sequence

from kvserve.sampling_params import SamplingParams
from kvserve.structured.manager import StructuredOutputManager
from kvserve.tokenizer import Tokenizer


def is_token_id(value: object) -> bool:
    """An integer of any type (numpy's too: ``operator.index`` takes it), not a bool."""
    return hasattr(value, "__index__") and not isinstance(value, bool)


def tokenize_prompt(
    tokenizer: Tokenizer, vocab_size: int, prompt: str | list[int]
) -> tuple[str | None, list[int]]:
    """(the prompt text or None, its token ids); ValueError for an empty prompt, a value
    that is neither text nor token ids, or an id outside the vocabulary."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Sequence) or not prompt:
        raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
    ids = []
    for t in prompt:
        if not is_token_id(t):
            raise ValueError(f"prompt token ids must be integers, got {t!r}")
        tid = operator.index(t)
        if not 0 <= tid < vocab_size:
            raise ValueError(f"prompt token id {tid} is outside the vocabulary [0, {vocab_size})")
        ids.append(tid)
    return None, ids


def check_constraints(
    params: SamplingParams, vocab_size: int, structured: StructuredOutputManager
) -> None:
    """ValueError for a logit_bias id outside the vocabulary or a constraint that does
    not compile (before anything is queued)."""
    for t in params.logit_bias or {}:
        if t >= vocab_size:
            raise ValueError(
                f"SamplingParams.logit_bias token id {t} is outside the vocabulary "
                f"[0, {vocab_size})"
            )
    if params.structured_outputs is not None:
        structured.validate(params.structured_outputs)
