"""Per-call cost of the amx_int8 kernel on tiny weights (needs amx_int8.patch applied).

A version of the kernel that asked CPUID on every call took 23.9 us hot at N=32, K=32, M=1,
one thread; with the answer cached, as in the patch, 2.7-2.9 us. The VNNI and AMX bf16
kernels run beside it for scale.

    git apply bench/results/session20/amx_int8.patch
    PYTHONPATH=. .venv/bin/python bench/results/session20/amx_int8_call_probe.py 1
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable

import torch

from kvserve.models.quant import quantize_dense
from kvserve.models.quant_linear import kernel_layout
from kvserve.runtime.native import quant_ops


def best_us(fn: Callable[[], object], reps: int = 2000) -> float:
    """The best of ``reps`` timed calls of ``fn``, in microseconds (after one warm-up)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def main() -> None:
    """Print hot us per call of each kernel at two tiny shapes and M = 1, 16."""
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    assert quant_ops.load(), quant_ops.reason()
    for n, k in ((32, 32), (32, 576)):
        w = kernel_layout(quantize_dense(torch.randn(n, k) * 0.02, "q4_1"), "x16").data
        for m in (1, 16):
            x = torch.randn(m, k).to(torch.bfloat16)  # [M, K]
            out = torch.empty(m, n, dtype=torch.bfloat16)  # [M, N]
            run = functools.partial(quant_ops.linear, x, w, "q4_1", out=out, layout="x16")
            int8 = best_us(functools.partial(run, isa="amx_int8"))
            bf16 = best_us(functools.partial(quant_ops.amx_bf16_linear, x, w, "q4_1", out=out))
            vnni = best_us(run)
            print(f"{n} {k} {m} hot amx_int8 {int8:.1f} amx_bf16 {bf16:.1f} vnni {vnni:.1f} us")


if __name__ == "__main__":
    main()
