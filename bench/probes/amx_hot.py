"""The AMX kernel against torch.mm and oneDNN with the weight hot (in the caches): compute
alone, in us per call and TFLOPS.

    PYTHONPATH=. .venv/bin/python bench/probes/amx_hot.py [--rows 32 64 128 512] [--threads 2]

One weight per shape (qkv 960x576 and gate/up 3072x576, bf16), called 200 times after 20
warm-up calls: what each kernel computes at M rows once the weight need not come from
memory (docs/KERNELS_HISTORY.md, session 10: what bounds the kernel above 32 rows).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvserve.runtime import native
from kvserve.runtime.amx_linear import amx_available, pack_weight

SHAPES = [(960, 576), (3072, 576)]


def kernels(
    x: torch.Tensor, out: torch.Tensor, w: torch.Tensor, packed: torch.Tensor, w_onednn: object
) -> dict[str, Callable[[], object]]:
    """The three kernels, each a call of ``out = x @ w^T`` on its own layout of ``w``."""
    w_t = w.t()
    return {
        "amx_bf16": lambda: torch.ops.kvserve.amx_linear(out, x, packed),
        "mm_bf16": lambda: torch.mm(x, w_t, out=out),
        "onednn_bf16": lambda: torch.ops.mkldnn._linear_pointwise(
            x, w_onednn, None, "none", [], ""
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 512])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not amx_available():
        raise SystemExit(f"no AMX-BF16 here: {native.reason() or 'the CPU lacks it'}")
    torch.set_num_threads(args.threads)
    for n, k in SHAPES:
        w = torch.randn(n, k).to(torch.bfloat16)  # [N, K]
        packed = pack_weight(w)
        w_onednn = torch.ops.mkldnn._reorder_linear_weight(w, None)
        for m in args.rows:
            x = torch.randn(m, k).to(torch.bfloat16)  # [M, K]
            out = torch.empty(m, n, dtype=torch.bfloat16)  # [M, N]
            row = []
            for name, call in kernels(x, out, w, packed, w_onednn).items():
                for _ in range(20):
                    call()
                t = time.perf_counter()
                for _ in range(200):
                    call()
                dt = (time.perf_counter() - t) / 200
                row.append(f"{name} {dt * 1e6:.0f} us {2 * m * n * k / dt / 1e12:.2f} TFLOPS")
            print(f"{n}x{k} M={m}: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
