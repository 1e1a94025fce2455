"""The TP comparison helpers live in kvserve.bench.tp (the benchmark uses them too)."""

from kvserve.bench.tp import RecordingSampler, RunResult, compare, prompts_5_to_600, run_engine

__all__ = ["RecordingSampler", "RunResult", "compare", "prompts_5_to_600", "run_engine"]
