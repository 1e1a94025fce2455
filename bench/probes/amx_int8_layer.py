"""The int8 AMX kernel (``kvserve::amx_int8_linear``) against ``amx_bf16_linear`` and the
VNNI kernel (``linear``) on the Q4_1 blocks, on the embedded model's projection shapes: a
decode step's 30 layers x 4 projections in step order (Q4_1 66 MB, int8 113 MB, streamed as
a step streams them), ms per pass at M = 1, 16, 32, 64 and 128, two threads, the kernels
alternated round by round.

    PYTHONPATH=. .venv/bin/python bench/probes/amx_int8_layer.py [THREADS] [ROUNDS]
"""

from __future__ import annotations

import sys
import time

import torch

from kvserve.models.quant import quantize_dense
from kvserve.models.quant_linear import kernel_layout
from kvserve.runtime import native
from kvserve.runtime.amx_int8 import amx_int8_available, pack_int8_weight
from kvserve.runtime.native import quant_ops

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate/up, down: [N, K]
LAYERS = 30


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    native.load()
    if not (quant_ops.available() and quant_ops.amx_bf16_available() and amx_int8_available()):
        raise SystemExit("needs amx_bf16_linear and amx_int8_linear")
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    q4 = [
        [
            kernel_layout(quantize_dense(torch.randn(*s, generator=gen) * 0.02, "q4_1"), "x16")
            for s in SHAPES
        ]
        for _ in range(LAYERS)
    ]
    i8 = [[pack_int8_weight(w.dequantize(torch.float32)) for w in layer] for layer in q4]

    def run_q4(xs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        for layer in q4:
            for w, x, o in zip(layer, xs, outs, strict=True):
                quant_ops.amx_bf16_linear(x, w.data, "q4_1", out=o)

    def run_i8(xs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        for layer in i8:
            for w, x, o in zip(layer, xs, outs, strict=True):
                torch.ops.kvserve.amx_int8_linear(o, x, w)

    def run_vnni(xs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        for layer in q4:
            for w, x, o in zip(layer, xs, outs, strict=True):
                quant_ops.linear(x, w.data, "q4_1", out=o, layout="x16")

    kernels = (("q4_1 vnni", run_vnni), ("q4_1 amx_bf16", run_q4), ("int8 amx", run_i8))
    for m in (1, 16, 32, 64, 128):
        xs = [torch.randn(m, k, generator=gen).to(torch.bfloat16) for _, k in SHAPES]  # [M, K]
        outs = [torch.empty(m, n, dtype=torch.bfloat16) for n, _ in SHAPES]  # [M, N]
        best = dict.fromkeys([name for name, _ in kernels], float("inf"))
        for _ in range(rounds):
            for name, fn in kernels:
                t0 = time.perf_counter()
                fn(xs, outs)
                best[name] = min(best[name], time.perf_counter() - t0)
        times = "  ".join(f"{name} {t * 1e3:6.2f} ms" for name, t in best.items())
        print(f"M={m:3d}: {times}  [{threads} threads, best of {rounds}]")


if __name__ == "__main__":
    main()
