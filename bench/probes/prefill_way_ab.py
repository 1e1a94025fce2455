"""A whole prefill with long chunks through the AMX prefill kernel against SDPA, in one process.

    PYTHONPATH=. .venv/bin/python bench/probes/prefill_way_ab.py [--rounds 4]

The engine's default flags on the embedded model (``max_model_len`` 4096) but
``kernel_selection="measure"``, so its start-up chunk choice is measured again and its log
line (us a layer by rows, each way) printed. Then B random prompts of n tokens, one greedy
token each (so all prefill, in chunks of the token budget), for (B, n) in (32, 128),
(8, 1920) and (2, 3800): each round runs the batch with the backend's long chunks on SDPA
(``chunk_amx`` off), then on the AMX kernel (``chunk_amx`` on); chunks up to the start-up
limit take the decode kernel in both. Switching the way on the live backend is the only
difference between the two arms, so the host's drift falls on both. Printed: the sorted
seconds of each arm, the ratio of medians.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time

import torch

from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams

CASES = ((32, 128), (8, 1920), (2, 3800))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(2)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("kvserve.runtime.native.chunk_limit").setLevel(logging.INFO)
    logging.getLogger("kvserve").setLevel(logging.INFO)
    llm = LLM(max_model_len=4096, kernel_selection="measure")
    logging.getLogger("kvserve").setLevel(logging.WARNING)
    backend = llm.engine.runner.model.attn_backend
    chosen = (backend.chunk_kernel_max_tokens, backend.chunk_amx)
    print(f"start-up choice: decode kernel up to {chosen[0]} rows, AMX kernel above: {chosen[1]}")
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)

    def prompts(batch: int, n: int) -> list[list[int]]:
        return [[rng.randrange(100, 49000) for _ in range(n)] for _ in range(batch)]

    llm.generate(prompts(2, 64), params, use_tqdm=False)
    for batch, n in CASES:
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for amx in (False, True):
                backend.chunk_amx = amx
                batch_prompts = prompts(batch, n)
                t = time.perf_counter()
                llm.generate(batch_prompts, params, use_tqdm=False)
                times[amx].append(time.perf_counter() - t)
        ratio = statistics.median(times[False]) / statistics.median(times[True])
        sdpa, amx = ([round(x, 3) for x in sorted(times[way])] for way in (False, True))
        print(f"prefill {batch} x {n}: SDPA {sdpa} s, AMX {amx} s; {ratio:.2f}x")


if __name__ == "__main__":
    main()
