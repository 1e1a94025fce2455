"""The lm_head and the logits' `.float()` timed around each call in a `kvserve bench
throughput` run (steps with 32 sampling rows): median, p90, max and total.

    PYTHONPATH=. .venv/bin/python bench/results/session21/logits_time.py bench throughput \
        --workload-file bench/results/session21/first/sharegpt/workload_sharegpt_64.jsonl \
        --num-prompts 64 --max-num-seqs 32 --num-threads 2
"""

from __future__ import annotations

import sys
import time

import torch

import kvserve.models.llama as llama
from kvserve.cli import main

STATS: dict[str, list[float]] = {"lm_head": [], "float": []}


def timed_logits(self: llama.LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """compute_logits with its two parts timed."""
    if self._lm_head_key is None:
        self._build_lm_head()
    t0 = time.perf_counter()
    logits = self.lm_head_proj(hidden)  # [N, V] in the model's dtype
    t1 = time.perf_counter()
    out = logits.float()  # [N, V]
    t2 = time.perf_counter()
    if hidden.shape[0] == 32:
        STATS["lm_head"].append(t1 - t0)
        STATS["float"].append(t2 - t1)
    return out


if __name__ == "__main__":
    llama.LlamaForCausalLM.compute_logits = timed_logits
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
    for name, times in STATS.items():
        t = sorted(times)
        print(
            f"{name}: {len(t)} calls, median {t[len(t) // 2] * 1e3:.2f} ms, "
            f"p90 {t[int(len(t) * 0.9)] * 1e3:.2f}, max {t[-1] * 1e3:.2f}, total {sum(t):.2f} s"
        )
