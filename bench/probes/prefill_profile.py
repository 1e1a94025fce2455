"""Where a batch's prefill goes: torch.profiler over the engine prefilling B prompts at once.

    PYTHONPATH=. .venv/bin/python bench/probes/prefill_profile.py [--batch 32] [--len 128]
        [--threads 2] [--rows 25]

B random prompts of ``--len`` tokens, one greedy token each (so the run is all prefill, in
chunks of the engine's default token budget), the engine's default flags on the embedded
model. A warm-up batch runs first; then one timed batch and one under the profiler, whose
table (self CPU time) is printed.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(max_model_len=max(2048, args.len + 1))
    rng = random.Random(0)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(100, 49000) for _ in range(args.len)] for _ in range(args.batch)]

    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    llm.generate(prompts()[:4], params, use_tqdm=False)
    t = time.perf_counter()
    llm.generate(prompts(), params, use_tqdm=False)
    print(f"prefill of {args.batch} x {args.len} tokens: {time.perf_counter() - t:.3f} s")
    with torch.profiler.profile() as prof:
        t = time.perf_counter()
        llm.generate(prompts(), params, use_tqdm=False)
        print(f"the same, profiled: {time.perf_counter() - t:.3f} s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(f"token budget (max_num_batched_tokens): {llm.engine.config.max_num_batched_tokens}")


if __name__ == "__main__":
    main()
