"""The K-quant kernels as stored against the repacks they replaced, per shape and M.

    .venv/bin/python -m kvserve.bench.kquant_speed [--m 1 8 32] [--rounds 10] [--threads 2]
        [--shapes 576x1536 2048x8192 8192x2048]

Before the K-quant kernels, a Q4_K weight was repacked at load to Q4_1 (5.0 bits a weight
instead of 4.5) and a Q6_K weight re-quantized to Q8_0 (8.5 instead of 6.56); both then ran
in the layout that layout "auto" picks on this CPU (x16 on AVX2 and AVX-512 VNNI). Timed
here: ``q4_k`` / ``q5_k`` / ``q6_k`` as stored, ``q4_1`` and ``q8_0`` in that layout, fp32
activations, ``out x in`` shapes (the default ones: SmolLM2's down projection and
Llama-3.2-1B's down and gate). Each format's weight is held in enough distinct copies that a
round streams ~64 MB from memory (no cache reuse between calls, as in a decode step); per
round the formats take turns (so a burst of load on a shared machine hits all of them); the
best round counts. Printed: microseconds per call and the weight bytes read per second.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.models.quant import QuantizedWeight, bits_per_weight, quantize_dense
from kvserve.models.quant_linear import kernel_layout
from kvserve.runtime.native import quant_ops

FORMATS = ("q4_k", "q4_1", "q5_k", "q6_k", "q8_0")
STREAM_BYTES = 64 << 20


def copies_of(weight: QuantizedWeight, copies: int) -> list[QuantizedWeight]:
    """``copies`` weights of the same bytes at distinct addresses."""
    return [
        QuantizedWeight(weight.qtype, weight.data.clone(), weight.shape, weight.layout)
        for _ in range(copies)
    ]


def time_calls(weights: list[QuantizedWeight], x: torch.Tensor, out: torch.Tensor) -> float:
    """Seconds per call over one pass of ``weights``."""
    t = time.perf_counter()
    for w in weights:
        quant_ops.linear(x, w.data, w.qtype, out=out, layout=w.layout)
    return (time.perf_counter() - t) / len(weights)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--shapes", nargs="+", default=["576x1536", "2048x8192", "8192x2048"])
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    args = ap.parse_args(argv)
    if not quant_ops.available():
        raise SystemExit(f"quantized kernels unavailable: {quant_ops.reason()}")
    torch.set_num_threads(args.threads)
    print(f"isa {quant_ops.best_isa()}; threads {args.threads}; best of {args.rounds} rounds")
    print(f"{'shape':>10s} {'M':>3s} " + " ".join(f"{f:>22s}" for f in args.formats))
    gen = torch.Generator().manual_seed(0)
    for spec in args.shapes:
        out_f, in_f = (int(v) for v in spec.split("x"))
        dense = torch.randn(out_f, in_f, generator=gen)
        held = {}
        for qtype in args.formats:
            weight = kernel_layout(quantize_dense(dense, qtype))
            held[qtype] = copies_of(weight, max(1, STREAM_BYTES // weight.nbytes))
        for m in args.m:
            x = torch.randn(m, in_f, generator=gen)
            out = torch.empty(m, out_f)
            best = dict.fromkeys(args.formats, float("inf"))
            for _ in range(args.rounds):
                for qtype in args.formats:
                    best[qtype] = min(best[qtype], time_calls(held[qtype], x, out))
            cells = []
            for qtype in args.formats:
                w = held[qtype][0]
                gbs = w.nbytes / best[qtype] / 1e9
                cells.append(
                    f"{1e6 * best[qtype]:8.1f} us {gbs:5.1f} GB/s"
                    f"{'*' if w.layout == 'x16' else ' '}"
                )
            print(f"{spec:>10s} {m:3d} " + " ".join(f"{c:>22s}" for c in cells))
    bits = ", ".join(f"{q} {bits_per_weight(q):g}" for q in args.formats)
    print(f"bits a weight: {bits}; * = x16 layout")


if __name__ == "__main__":
    main()
