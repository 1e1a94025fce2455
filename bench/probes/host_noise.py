"""How much this host's step time jitters, apart from any scheduling policy (issue 21).

    PYTHONPATH=. .venv/bin/python bench/probes/host_noise.py [--repeats 1500] [--steps 400]

Two figures, each as p50 / p90 / p99 ms and p99 / p50:

- a fixed GEMM loop: (4 x 2304) @ (2304 x 4608) three times per sample, with 2 threads and
  with 1 (the first 100 samples dropped);
- the offline engine's decode steps at a fixed batch (``LLM(num_threads=2)``, greedy, EOS
  ignored, ``--steps`` tokens): the engine's own ``step_records`` of the decode-only steps.

A p99 ITL within 2x the median cannot be shown on a host whose fixed work already has a
p99 near 2x its median, whatever the scheduler does.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def summary(ms: np.ndarray) -> str:
    """p50 / p90 / p99 of ``ms`` and p99 / p50."""
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return f"p50 / p90 / p99 {p50:.2f} / {p90:.2f} / {p99:.2f} ms, p99/p50 {p99 / p50:.2f}"


def gemm_loop(threads: int, repeats: int) -> np.ndarray:
    """Milliseconds of each of ``repeats`` samples of the fixed GEMM loop."""
    torch.set_num_threads(threads)
    x = torch.randn(4, 2304)  # [M, K]
    w = torch.randn(4608, 2304)  # [N, K]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(3):
            x @ w.T
        times.append(time.perf_counter() - t0)
    return np.asarray(times[100:]) * 1e3


def engine_steps(batch_sizes: list[int], steps: int) -> dict[int, np.ndarray]:
    """Milliseconds of the offline engine's decode-only steps at each batch size."""
    from kvserve import LLM, SamplingParams

    llm = LLM(num_threads=2)
    engine = llm.engine
    out = {}
    for b in batch_sizes:
        engine.step_records.clear()
        params = SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0.0)
        llm.generate(["Tell me a long story about a cat"] * b, params, use_tqdm=False)
        recs = [
            r
            for r in engine.step_records
            if r["num_prefill_tokens"] == 0 and r["num_decode_tokens"] == b
        ]
        out[b] = np.asarray([r["seconds"] for r in recs]) * 1e3
    return out


def main() -> None:
    """Run both measurements and print one line each."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1500)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    for threads in (2, 1):
        print(f"GEMM loop, {threads} thread(s): {summary(gemm_loop(threads, args.repeats))}")
    torch.set_num_threads(2)
    for b, ms in engine_steps(args.batch_sizes, args.steps).items():
        print(f"engine decode steps, B={b} ({len(ms)} steps): {summary(ms)}")


if __name__ == "__main__":
    main()
