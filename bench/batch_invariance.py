"""Greedy outputs of the embedded model under batch formations against a roomy reference run
(issue 50): how many of 6 prompts changed their tokens, and how many their logprobs' bits.

    PYTHONPATH=. .venv/bin/python bench/batch_invariance.py [auto|none] [key=value ...]

``auto`` / ``none``: the quantization (default auto: the GGUF as stored); ``key=value``: extra
engine options for every run (``batch_invariant=0`` for the per-bucket kernels). The
reference has prefix caching off and a roomy pool; the prompts are the e2e tests' six chat
prompts, lengthened by 0-200 tokens, 24 greedy tokens each.
"""

from __future__ import annotations

import sys
import time

import torch

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.e2e.prompts import chat_prompts

SCENARIOS = {
    "prefix cache on": {"num_kv_blocks": 512},
    "budget 16": {
        "num_kv_blocks": 512,
        "max_num_batched_tokens": 16,
        "enable_prefix_caching": False,
    },
    "budget 64": {"num_kv_blocks": 512, "max_num_batched_tokens": 64},
    "recompute": {
        "num_kv_blocks": 40,
        "preemption_mode": "recompute",
        "max_num_batched_tokens": 256,
    },
    "swap": {"num_kv_blocks": 40, "preemption_mode": "swap", "max_num_batched_tokens": 256},
}


def _value(text: str) -> object:
    return {"0": False, "1": True}.get(text, text)


def main() -> None:
    """Print one line per scenario."""
    torch.set_num_threads(2)
    quant = sys.argv[1] if len(sys.argv) > 1 else "auto"
    extra = {k: _value(v) for k, v in (a.split("=", 1) for a in sys.argv[2:])}
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)

    def run(**kw: object) -> tuple[list[tuple[list[int], list[float]]], dict, float]:
        t = time.time()
        llm = LLM(quantization=quant, dtype="float32", max_model_len=2048, **extra, **kw)
        prompts = [p + p[: 40 * i] for i, p in enumerate(chat_prompts(llm.tokenizer))]
        outs = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        res = [
            (
                list(c.token_ids),
                [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)],
            )
            for c in outs
        ]
        return res, llm.stats(), time.time() - t

    ref, _, _ = run(num_kv_blocks=512, enable_prefix_caching=False)
    for name, kw in SCENARIOS.items():
        got, stats, dt = run(**kw)
        tokens = sum(g[0] != r[0] for g, r in zip(got, ref, strict=True))
        bits = sum(g[1] != r[1] for g, r in zip(got, ref, strict=True))
        print(
            f"{name}: tokens changed {tokens}/6, logprob bits changed {bits}/6, "
            f"preemptions {stats['preemptions']}, {dt:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
