"""The per-layer native ops on the embedded model's shapes, hot: us per call of
``add_rms_norm`` ([rows, 576] with a residual) and ``silu_mul`` ([rows, 2 x 1536] -> [rows,
1536]) in bf16 (``--dtype``: each given dtype in turn), at decode (32 rows) and prefill (512
rows) sizes, one and two threads. The inputs stay in cache, so this is the ops' arithmetic,
plus ~2-3 us of Python and dispatcher per call.

    PYTHONPATH=. .venv/bin/python bench/probes/layer_ops_hot.py [--dtype bfloat16 float32]

Run from a tree's root with that tree on PYTHONPATH (and its own KVSERVE_CACHE_DIR) to time
that tree's kernels (bench/ab_tree.sh).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvserve.runtime import native


def best_us(fn: Callable[[], None], calls: int = 200) -> float:
    """Best of 5 timed loops of ``calls`` calls, after 50 warm-up calls: us per call."""
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def time_ops(rows: int, gen: torch.Generator, dtype: torch.dtype) -> tuple[float, float]:
    """us per call of add_rms_norm and of silu_mul on ``rows`` rows of ``dtype``."""
    ops = native.ops()
    hidden = torch.randn(rows, 576, generator=gen).to(dtype)  # [rows, 576]
    residual = torch.randn(rows, 576, generator=gen).to(dtype)  # [rows, 576]
    weight = torch.rand(576, generator=gen).to(dtype)  # [576]
    normed = torch.empty_like(hidden)  # [rows, 576]
    gate_up = torch.randn(rows, 3072, generator=gen).to(dtype)  # [rows, 2 x 1536]
    act = torch.empty(rows, 1536, dtype=dtype)  # [rows, 1536]
    # NOTE: the residual add repeats in place; N(0, 1) residuals keep it far from overflow
    # over these few thousand calls.
    norm = best_us(lambda: ops.add_rms_norm(hidden, residual, weight, 1e-5, normed))
    silu = best_us(lambda: ops.silu_mul(act, gate_up))
    return norm, silu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    args = ap.parse_args()
    if not native.load():
        raise SystemExit(f"no native kernels: {native.reason()}")
    gen = torch.Generator().manual_seed(0)
    for name in args.dtype:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (32, 512):
                norm, silu = time_ops(rows, gen, getattr(torch, name))
                print(f"{name} threads={threads} rows={rows:3d}: add_rms_norm {norm:6.1f} us  "
                      f"silu_mul {silu:6.1f} us")  # fmt: skip


if __name__ == "__main__":
    main()
