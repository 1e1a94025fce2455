"""The x16 int8-dot kernel with its weight hot in cache: GMAC/s per projection shape and M,
the kernel's compute alone (against `bench/probes/vnni_peak.cpp`'s issue rate).

    PYTHONPATH=. .venv/bin/python bench/probes/quant_hot.py [THREADS]
"""

from __future__ import annotations

import sys
import time

import torch

from kvserve.models.quant import quantize_dense
from kvserve.models.quant_linear import kernel_layout
from kvserve.runtime.native import quant_ops

SHAPES = [(576, 576), (960, 576), (3072, 576)]  # o, qkv, gate/up: [N, K]


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    if not quant_ops.available():
        raise SystemExit(f"quantized kernels unavailable: {quant_ops.reason()}")
    torch.set_num_threads(threads)
    for n, k in SHAPES:
        w = kernel_layout(quantize_dense(torch.randn(n, k) * 0.02, "q4_1"), "x16")
        for m in (1, 8, 32, 128):
            x = torch.randn(m, k).to(torch.bfloat16)  # [M, K]
            out = torch.empty(m, n, dtype=torch.bfloat16)  # [M, N]
            for _ in range(20):
                quant_ops.linear(x, w.data, "q4_1", out=out, layout=w.layout)
            best = float("inf")
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(50):
                    quant_ops.linear(x, w.data, "q4_1", out=out, layout=w.layout)
                best = min(best, (time.perf_counter() - t0) / 50)
            print(
                f"{n}x{k} M={m}: {best * 1e6:8.1f} us {n * k * m / best / 1e9:6.1f} GMAC/s "
                f"{w.nbytes / best / 1e9:6.1f} GB/s ({threads} threads, weight hot)"
            )


if __name__ == "__main__":
    main()
