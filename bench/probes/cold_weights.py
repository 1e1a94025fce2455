"""A projection's time with its weight hot in the caches vs cold (each call on another copy).

    PYTHONPATH=. .venv/bin/python bench/probes/cold_weights.py [--threads 2] [--mb 128]

For the embedded model's bf16 projection shapes at a few M: torch.mm (``DenseMmMethod``) and
oneDNN prepacked (``OneDnnPrepackedMethod``), best of 5 passes, us per call. "hot": one
weight, called again and again; "cold": calls rotate through copies holding about ``--mb``
MB, as the model's layers do (docs/KERNELS_HISTORY.md: why the selection times cold weights).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.runtime.linear import DenseMmMethod, LinearMethod, OneDnnPrepackedMethod

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate/up, down
METHODS = (DenseMmMethod, OneDnnPrepackedMethod)


def per_call_us(cls: type[LinearMethod], shape: tuple[int, int], m: int, copies: int) -> float:
    """Best pass over ``copies`` weights of ``shape``, us per call, ``m`` rows."""
    methods = [cls(torch.randn(shape, dtype=torch.bfloat16)) for _ in range(copies)]  # type: ignore[call-arg]
    x = torch.randn(m, shape[1], dtype=torch.bfloat16)  # [M, in]
    out = torch.empty(m, shape[0], dtype=torch.bfloat16)  # [M, out]
    for meth in methods:
        meth.apply(x, out)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for meth in methods:
            meth.apply(x, out)
        best = min(best, (time.perf_counter() - t) / copies)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mb", type=float, default=128.0, help="bytes of copies for 'cold'")
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 20, 36, 132, 512])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for shape in SHAPES:
        copies = max(1, int(args.mb * 2**20 / (shape[0] * shape[1] * 2)))
        for m in args.rows:
            hot = [per_call_us(c, shape, m, 1) for c in METHODS]
            cold = [per_call_us(c, shape, m, copies) for c in METHODS]
            print(
                f"{shape[0]}x{shape[1]} M={m}: hot mm {hot[0]:.0f} onednn {hot[1]:.0f} | "
                f"cold mm {cold[0]:.0f} onednn {cold[1]:.0f} us",
                flush=True,
            )


if __name__ == "__main__":
    main()
