"""Stepping an engine to the end, shared by the end-to-end tests that drive ``LLMEngine``."""

from __future__ import annotations

from kvserve.engine import LLMEngine
from kvserve.outputs import RequestOutput


def drain(engine: LLMEngine, max_steps: int = 500) -> dict[str, RequestOutput]:
    """Step ``engine`` until no request is left (at most ``max_steps`` steps), checking the KV
    cache's integrity after each step; the final output of each request, by request id."""
    finals: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.kv_cache_manager.check_integrity()
    assert not engine.has_unfinished_requests()
    return finals
