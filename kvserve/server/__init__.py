"""OpenAI-compatible HTTP server: ``build_app(engine)``; ``kvserve serve`` runs it."""

from __future__ import annotations

from typing import Any

__all__ = ["build_app"]


def __getattr__(name: str) -> Any:
    # NOTE: lazy, so `kvserve generate` does not pay for importing FastAPI.
    if name == "build_app":
        from kvserve.server.app import build_app

        return build_app
    raise AttributeError(name)
