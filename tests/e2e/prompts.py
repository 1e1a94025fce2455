"""Prompts shared by the end-to-end tests."""

from __future__ import annotations

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


def chat_prompts(tokenizer: object) -> list[list[int]]:
    """The QUESTIONS under the shared SYSTEM prompt, chat-templated to token ids."""
    return [
        tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        )
        for q in QUESTIONS
    ]
