"""The routing key of an OpenAI request: what the prefix tree matches on (torch-free).

Token-id prompts route on their ids. Text routes on its UTF-8 bytes (chat: the messages as
``role NUL content NUL ...``), offset past the token-id range so the two never match each
other. NOTE: byte prefixes stand in for token prefixes so that the router needs no tokenizer
(it fronts any OpenAI server); a shared text prefix is a shared token prefix up to the last
few tokens at its end, which is what an approximate tree needs. SGLang's router matches on
characters for the same reason.
"""

from __future__ import annotations

from typing import Any

# NOTE: above any real vocabulary, so that bytes and token ids live in separate ranges.
TEXT_OFFSET = 1 << 24
# The longest key kept per request: longer prompts are routed on this many leading elements.
MAX_KEY_LEN = 16384


def request_key(body: dict[str, Any]) -> list[int]:
    """The routing key of a /v1/completions or /v1/chat/completions body (may be empty)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
            parts.append(f"{m.get('role', '')}\0{content if content is not None else ''}\0")
        return _text_key("".join(parts))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return _id_key(prompt)
        if isinstance(first, list):  # a batch of token lists: route on the first
            return _id_key(first)
        if isinstance(first, str):  # a batch of strings: route on the first
            return _text_key(first)
    if isinstance(prompt, str):
        return _text_key(prompt)
    return []


def _id_key(ids: list[Any]) -> list[int]:
    """The leading token ids of ``ids`` (up to the first element that is not one).

    NOTE: the router routes and never validates: a bad element is the replica's to reject
    (a 400 naming it), so the key stops there instead of raising."""
    key = []
    for t in ids[:MAX_KEY_LEN]:
        if not isinstance(t, int) or isinstance(t, bool):
            break
        key.append(t)
    return key


def _text_key(text: str) -> list[int]:
    data = text.encode("utf-8", errors="replace")[:MAX_KEY_LEN]
    return [TEXT_OFFSET + b for b in data]
