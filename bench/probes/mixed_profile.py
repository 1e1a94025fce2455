"""Where a prefill chunk's cost goes: ``torch.profiler`` over engine steps with 4 decodes
plus one c-token chunk, against the same decodes alone.

    PYTHONPATH=. .venv/bin/python bench/probes/mixed_profile.py 0 16 32 48

For each c: 5 pairs of steps (a step with a new c-token prompt beside the 4 decodes, then the
step that finishes it), or 10 pure-decode steps for c = 0; prints the top ops by self CPU time
(ms summed over the 10 steps, call counts). The difference to c = 0, over 5, is what one
chunk adds to its step (bench/README.md, ITL section, session 9).
"""

from __future__ import annotations

import random
import sys

from torch.profiler import ProfilerActivity, profile

from kvserve.engine import LLMEngine
from kvserve.engine_config import EngineConfig
from kvserve.sampling_params import SamplingParams


def main() -> None:
    chunks = [int(a) for a in sys.argv[1:]] or [0, 16, 32]
    eng = LLMEngine(
        EngineConfig(num_threads=2, enable_prefix_caching=False, max_num_batched_tokens=1024)
    )
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    long_run = SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    for _ in range(4):
        eng.add_request(prompt(200), long_run)
    for _ in range(3):
        eng.step()

    def steps(c: int) -> None:
        for _ in range(5):
            if c:
                eng.add_request(prompt(c), one)
            eng.step()
            eng.step()

    for c in chunks:
        steps(c)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            steps(c)
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in events) / 1e3
        print(f"c = {c}: self CPU {total:.1f} ms over 10 steps")
        for e in events[:12]:
            print(f"  {e.key[:45]:45s} {e.self_cpu_time_total / 1e3:8.2f} ms {e.count:6d}")


if __name__ == "__main__":
    main()
