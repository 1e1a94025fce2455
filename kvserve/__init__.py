"""kvserve: an LLM serving engine built around KV-cache memory management.

Public API: :class:`LLM`, :class:`SamplingParams`, :class:`EngineConfig`, :class:`LLMEngine`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# NOTE: libgomp reads this once, when torch first loads. Its default (spin 300,000 times
# before sleeping) makes OpenMP threads collapse whenever another process shares the cores;
# 10,000 spins cost nothing measurable alone (figures: bench/README.md, "Measurements behind
# constants in the code"). An explicit setting, or a torch imported before kvserve, wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from kvserve.engine.config import EngineConfig
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.llm import LLM
    from kvserve.engine.llm_engine import LLMEngine

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # NOTE: LLM and LLMEngine import torch; load them lazily so `import kvserve` (and core/)
    # stays torch-free and fast.
    if name == "LLM":
        from kvserve.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from kvserve.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
