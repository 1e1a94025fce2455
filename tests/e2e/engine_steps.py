"""Building and stepping an engine, shared by the end-to-end tests that drive ``LLMEngine``."""

from __future__ import annotations

from pathlib import Path

from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput


def small_engine(model_dir: Path) -> LLMEngine:
    """An engine on the tiny model in ``model_dir`` with a small pool (96 blocks of 4 tokens),
    one thread."""
    return LLMEngine(
        model=str(model_dir), block_size=4, max_model_len=64, num_threads=1, num_kv_blocks=96
    )


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
