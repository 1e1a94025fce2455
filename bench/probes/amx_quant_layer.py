"""``amx_bf16_linear`` on a layer's four Q4_1 projections of the embedded model's shapes: us per
call at M = 16, 32 and 64, two threads, over 30 layers' weights in turn (66 MB, as a decode
step streams them) and the sum over the four, i.e. a layer's projections.

    PYTHONPATH=. .venv/bin/python bench/probes/amx_quant_layer.py [THREADS]

Run from a tree's root with that tree on PYTHONPATH to time that tree's kernel (an A/B runs it
from both; see bench/ab_tree.sh).
"""

from __future__ import annotations

import sys
import time

import torch

from kvserve.models.quant import quantize_dense
from kvserve.models.quant_linear import kernel_layout
from kvserve.runtime.native import quant_ops

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate/up, down: [N, K]
LAYERS = 30


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    if not (quant_ops.available() and quant_ops.amx_bf16_available()):
        raise SystemExit(f"no amx_bf16_linear here: {quant_ops.reason()}")
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    weights = {
        s: [
            kernel_layout(quantize_dense(torch.randn(*s, generator=gen) * 0.02, "q4_1"), "x16")
            for _ in range(LAYERS)
        ]
        for s in SHAPES
    }
    for m in (16, 32, 64):
        parts, total = [], 0.0
        for n, k in SHAPES:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)  # [M, K]
            out = torch.empty(m, n, dtype=torch.bfloat16)  # [M, N]
            for w in weights[(n, k)][:3]:
                quant_ops.amx_bf16_linear(x, w.data, "q4_1", out=out)
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for w in weights[(n, k)]:
                    quant_ops.amx_bf16_linear(x, w.data, "q4_1", out=out)
                best = min(best, (time.perf_counter() - t0) / LAYERS)
            parts.append(f"{n}x{k} {best * 1e6:6.1f}")
            total += best
        layer = f"layer {total * 1e6:6.1f} us ({threads} threads)"
        print(f"M={m:3d}: " + "  ".join(parts) + "  " + layer)


if __name__ == "__main__":
    main()
