"""Shared fixtures for end-to-end tests on the embedded SmolLM2-135M-Instruct model."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch

from kvserve.models.loader import default_model_path

# NOTE: prompts share a long system prefix (exercises the prefix cache) and differ after it;
# lengths vary so blocks end mid-prompt.
SYSTEM = (
    "You are a careful assistant. Answer in one or two short sentences, plainly, without "
    "lists. Facts first, then a brief reason."
)
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
]


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def make_llm() -> Iterator[Callable[..., object]]:
    """Factory for LLM instances (each loads the model; a few seconds)."""
    from kvserve.llm import LLM

    torch.set_num_threads(min(2, os.cpu_count() or 1))

    def factory(**kwargs: object) -> LLM:
        kwargs.setdefault("max_model_len", 2048)
        return LLM(**kwargs)  # type: ignore[arg-type]

    yield factory


def chat_prompts(tokenizer: object) -> list[list[int]]:
    """The QUESTIONS under the shared SYSTEM prompt, chat-templated to token ids."""
    return [
        tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        )
        for q in QUESTIONS
    ]
