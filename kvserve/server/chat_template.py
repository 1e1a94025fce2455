"""``--chat-template``'s value, read the same way by ``kvserve serve`` and by the
data-parallel replicas it starts (no kvserve imports: the CLI and the router both load it)."""

from __future__ import annotations

import os


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: the text of a file, or the value itself when it is a Jinja
    template (as vLLM). Exits with a message when it is neither."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{%" in value or "{{" in value:
        return value
    raise SystemExit(f"kvserve serve: --chat-template: no such file: {value}")
