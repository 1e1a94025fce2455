"""The AMX kernel over the embedded model's projection sequence at several M: the built
kernel against other sources of it, interleaved.

    PYTHONPATH=. .venv/bin/python bench/probes/amx_model_ab.py [SRC.cpp ...] [--rows 32 64 68]

What a step's projections cost at M rows: 30 layers of qkv 960x576, o 576x576, gate/up
3072x576 and down 576x1536 (212 MB of bf16 tiles, more than the caches hold, so each weight
comes from memory as in the model), each layer's four calls in the model's order. Each source
(e.g. ``git show REV:kvserve/runtime/native/kvserve_amx_linear.cpp > /tmp/old.cpp``) is built
as an op library of its own; the kernels take turns, five passes, best pass in ms. The host's
speed drifts by 10-30 % over minutes here, so read kernels against each other within a run.
``--huge-pages``: also the built kernel on the same weights copied into one huge-page buffer,
as the engine holds them (``huge`` in the output; kvserve/runtime/huge_pages.py).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from amx_ab import build_old

from kvserve.runtime import native
from kvserve.runtime.amx_linear import amx_available, pack_weight
from kvserve.runtime.huge_pages import into_huge_pages

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate/up, down
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", type=Path, nargs="*")
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 16, 20, 32, 36, 52, 64, 68, 128])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--huge-pages", action="store_true")
    args = ap.parse_args()
    if not amx_available():
        raise SystemExit(f"no AMX-BF16 here: {native.reason() or 'the CPU lacks it'}")
    torch.set_num_threads(args.threads)
    ops = {"built": torch.ops.kvserve.amx_linear}
    for i, src in enumerate(args.sources):
        ops[src.stem] = build_old(src, f"amx_model_ab_{i}")
    layers = [
        [pack_weight((torch.randn(n, k) * 0.05).to(torch.bfloat16)) for n, k in SHAPES]
        for _ in range(LAYERS)
    ]
    weight_sets = {name: layers for name in ops}
    if args.huge_pages:
        flat = into_huge_pages([p for weights in layers for p in weights])
        ops["huge"] = ops["built"]
        weight_sets["huge"] = [flat[i : i + len(SHAPES)] for i in range(0, len(flat), len(SHAPES))]
    for m in args.rows:
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in (576, 1536)}  # [M, K]
        outs = [torch.empty(m, n, dtype=torch.bfloat16) for n, _ in SHAPES]  # [M, N]
        best = dict.fromkeys(ops, float("inf"))
        for _ in range(args.passes):
            for name, op in ops.items():
                t = time.perf_counter()
                for weights in weight_sets[name]:
                    for (_, k), packed, out in zip(SHAPES, weights, outs, strict=True):
                        op(out, xs[k], packed)
                best[name] = min(best[name], time.perf_counter() - t)
        row = "  ".join(f"{name} {t * 1e3:.2f} ms" for name, t in best.items())
        print(f"M={m:4d} {row}", flush=True)


if __name__ == "__main__":
    main()
