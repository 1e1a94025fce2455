"""Engine step time with d running decodes plus one prefill chunk of c tokens.

    PYTHONPATH=. .venv/bin/python bench/probes/mixed_step.py --decodes 1 4 8 [--threads 2]

Default flags otherwise (prefix cache off so every chunk computes). For each d: d requests
with 200-token prompts decode while a new c-token prompt is prefilled in one step; the median
of 3 such steps (after one discarded), in ms, and its ratio to the pure-decode step (c = 0).
What a stream's gap becomes when a chunk shares its step (bench/README.md, ITL section).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvserve.engine import LLMEngine
from kvserve.engine_config import EngineConfig
from kvserve.sampling_params import SamplingParams

CHUNKS = (0, 16, 32, 64, 96, 128, 192, 256, 384, 512)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decodes", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    eng = LLMEngine(
        EngineConfig(
            num_threads=args.threads, enable_prefix_caching=False, max_num_batched_tokens=1024
        )
    )
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    long_run = SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    for d in args.decodes:
        ids = [eng.add_request(prompt(200), long_run) for _ in range(d)]
        for _ in range(3):
            eng.step()
        ms: dict[int, float] = {}
        for c in CHUNKS:
            times = []
            for _ in range(4):
                if c:
                    eng.add_request(prompt(c), one)
                t = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t)
                assert eng.step_records[-1]["num_prefill_tokens"] == c
                eng.step()  # the one-token request finishes
            ms[c] = statistics.median(times[1:]) * 1e3
        print(f"d={d}: " + "  ".join(f"{c}:{v:.1f}({v / ms[0]:.2f})" for c, v in ms.items()))
        for rid in ids:
            eng.abort_request(rid)
        for _ in range(2):
            eng.step()


if __name__ == "__main__":
    main()
