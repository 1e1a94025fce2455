"""What a greedy decode step spends on its logits after the lm_head, old path against new.

    PYTHONPATH=. .venv/bin/python bench/probes/greedy_logits.py [--rows 32] [--vocab 49152]
        [--threads 2]

bf16 logits [rows, vocab] (the lm_head's output at B=rows on the embedded model), made
afresh before each timed call (as the lm_head writes them each step). "widened": until
session 22, the runner's ``.float()`` copy, the guard's sum over it and the native argmax
of the float rows; "as written": the guard's sum and the argmax on the bf16 rows themselves
(``Sampler.sample``'s all-greedy path since session 22); "one pass": the argmax reporting
each row's finiteness itself (``sample_guarded``'s all-greedy path since session 23). Median
of ``--repeats`` calls, ms.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from kvserve.runtime import native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    if not native.available():
        raise SystemExit(f"no native kernels: {native.reason()}")
    torch.set_num_threads(args.threads)
    ops = native.ops()
    src = torch.randn(args.rows, args.vocab).bfloat16()  # [rows, vocab]
    logits = torch.empty_like(src)  # [rows, vocab] bf16, rewritten before each call
    out = torch.empty(args.rows, dtype=torch.long)  # [rows]

    def widened() -> None:
        wide = logits.float()  # [rows, vocab]
        assert math.isfinite(wide.sum().item())
        ops.argmax_rows(out, wide)

    def as_written() -> None:
        assert math.isfinite(logits.sum().item())
        ops.argmax_rows(out, logits)

    finite = torch.empty(args.rows, dtype=torch.bool)  # [rows]

    def one_pass() -> None:
        ops.argmax_rows(out, logits, finite)
        assert all(finite.tolist())

    for name, fn in (("widened", widened), ("as written", as_written), ("one pass", one_pass)) * 2:
        times = []
        for _ in range(args.repeats):
            logits.copy_(src)
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        print(f"{name}: {statistics.median(times) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
