"""Every quantized-weight candidate over the embedded model's projection sequence at M rows,
interleaved: what a step's projections cost per kernel, as a step runs them.

    PYTHONPATH=. .venv/bin/python bench/probes/quant_seq.py [--rows 1 8 32 128 512]
        [--qtype q4_1] [--dtype bfloat16] [--threads 2] [--passes 5] [--huge-pages]
        [--only SUBSTRING] [--layers 30]

30 layers (``--layers``: more, to exceed the L3 and read every weight from DRAM) of qkv
960x576, o 576x576, gate/up 3072x576 and down 576x1536 in ``--qtype``
(random weights, quantized and laid out as the engine lays them out on this CPU), each
layer's four calls in the model's order, so each weight comes from memory as in the model
(the dense copies are 212 MB in bf16, the Q4_1 blocks 60 MB; this CPU's L3 may hold some).
The candidates are the ones the engine's selection times (``quantized_candidates``), each
prepared (dense copies made) once; they take turns, best pass in ms. The selection times one
shape at a time; this is the check that its choice holds over a whole step. The host's speed
drifts over minutes here: read candidates against each other within a run.
``--huge-pages``: every candidate's streamed tensors gathered into huge pages first, as the
engine does at start-up (kvserve/runtime/linear.py, ``gather_into_huge_pages``).
``--only``: the candidates whose name holds the substring (e.g. ``vnni``). To time two
versions of the kernels against each other, run this file with ``PYTHONPATH`` at each
checkout in turn (each builds its own kernels).
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from kvserve.models.quant import quantize_dense
from kvserve.models.quant_linear import kernel_layout, quantized_candidates
from kvserve.runtime.linear import LinearMethod, gather_into_huge_pages

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate/up, down: [N, K]
LAYERS = 30
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build(
    qtype: str, dtype: torch.dtype, only: str, layers: int = LAYERS
) -> dict[str, list[list[LinearMethod]]]:
    """Candidate name -> [layer][projection] methods, prepared."""
    gen = torch.Generator().manual_seed(0)
    by_name: dict[str, list[list[LinearMethod]]] = {}
    for _ in range(layers):
        row: dict[str, list[LinearMethod]] = {}
        for n, k in SHAPES:
            weight = kernel_layout(quantize_dense(torch.randn(n, k, generator=gen) * 0.02, qtype))
            for method in quantized_candidates(weight, act_dtype=dtype, device=torch.device("cpu")):
                if only not in method.name:
                    continue
                method.prepare()
                row.setdefault(method.name.split(":")[0], []).append(method)
        for name, methods in row.items():
            by_name.setdefault(name, []).append(methods)
    return by_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 128, 512])
    ap.add_argument("--qtype", default="q4_1")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--huge-pages", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--layers", type=int, default=LAYERS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    by_name = build(args.qtype, dtype, args.only, args.layers)
    if args.huge_pages:
        methods = [m for layers in by_name.values() for row in layers for m in row]
        # NOTE: the gather walks Linears; one stand-in holding every method is enough.
        moved = gather_into_huge_pages([SimpleNamespace(methods=lambda: methods)])  # type: ignore[list-item]
        print(f"huge pages: {moved / 2**20:.1f} MiB moved")
    names = sorted(by_name)
    print(f"{args.qtype} x {args.layers} layers, {args.dtype}, {args.threads} threads; ms a pass:")
    print("rows  " + "  ".join(f"{n:>24}" for n in names))
    for m in args.rows:
        xs = {k: torch.randn(m, k).to(dtype) for k in (576, 1536)}  # [M, K]
        best = dict.fromkeys(names, float("inf"))
        with torch.inference_mode():
            for _ in range(args.passes):
                for name in names:
                    t0 = time.perf_counter()
                    for row in by_name[name]:
                        for method, (_, k) in zip(row, SHAPES, strict=True):
                            method.apply(xs[k])
                    best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
        print(f"{m:>4}  " + "  ".join(f"{best[n]:>24.2f}" for n in names))


if __name__ == "__main__":
    main()
