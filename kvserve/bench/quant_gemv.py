"""Quantized GEMV speed in GB/s: the int8-dot kernels on a decode step's weights vs read bandwidth.

    .venv/bin/python -m kvserve.bench.quant_gemv [--threads 1 2] [--m 1] [--rounds 20]
        [--layouts plain interleaved] [--layers 30]

The weights of the embedded model's decode step (per layer: qkv 960x576, o 576x576, gate_up
3072x576 and down 576x1536 in Q4_1; the tied lm_head 49152x576 in Q8_0), ``--layers`` distinct
copies of random blocks so that a step streams ~96 MB from memory as the model does (no cache
reuse between layers). Per round and thread count, the layouts and a ``torch.sum`` over a
buffer of the same size take turns (interleaved, so a burst of load on a shared machine hits
all of them); the best round counts. Printed per layout: ms per step, GB/s per shape (each
shape's calls timed together across layers) and the step's GB/s as a share of the
``torch.sum`` bandwidth.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.models.quant import QuantizedWeight, row_bytes
from kvserve.models.quant_linear import kernel_layout
from kvserve.runtime.native import quant_ops

# (name, out, in, qtype, per layer?)
SHAPES = (
    ("qkv", 960, 576, "q4_1", True),
    ("o", 576, 576, "q4_1", True),
    ("gate_up", 3072, 576, "q4_1", True),
    ("down", 576, 1536, "q4_1", True),
    ("lm_head", 49152, 576, "q8_0", False),
)


def random_weight(out_f: int, in_f: int, qtype: str, gen: torch.Generator) -> QuantizedWeight:
    """Random blocks of ``qtype`` with small finite fp16 scales (speed does not depend on them)."""
    data = torch.randint(0, 256, (out_f, row_bytes(qtype, in_f)), dtype=torch.uint8, generator=gen)
    bb = row_bytes(qtype, 32)
    scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)  # 2 bytes
    blocks = data.view(out_f, -1, bb)
    blocks[:, :, 0:2] = scale
    if qtype == "q4_1":
        blocks[:, :, 2:4] = scale
    return QuantizedWeight(qtype, data, (out_f, in_f))


def step_weights(layers: int, seed: int = 0) -> list[tuple[str, QuantizedWeight]]:
    """The decode step's weights in order (layer by layer, then the lm_head)."""
    gen = torch.Generator().manual_seed(seed)
    per_layer = [s for s in SHAPES if s[4]]
    out = []
    for _ in range(layers):
        out += [(n, random_weight(o, i, q, gen)) for n, o, i, q, _ in per_layer]
    out += [(n, random_weight(o, i, q, gen)) for n, o, i, q, per in SHAPES if not per]
    return out


def time_step(weights: list[tuple[str, QuantizedWeight]], m: int) -> tuple[float, dict[str, float]]:
    """Seconds of one pass over ``weights`` at M = ``m`` and seconds per shape name."""
    per: dict[str, float] = {}
    xs = {w.shape[1]: torch.randn(m, w.shape[1], dtype=torch.bfloat16) for _, w in weights}
    outs = {w.shape[0]: torch.empty(m, w.shape[0], dtype=torch.bfloat16) for _, w in weights}
    t_all = time.perf_counter()
    for name, w in weights:
        t = time.perf_counter()
        quant_ops.linear(xs[w.shape[1]], w.data, w.qtype, out=outs[w.shape[0]], layout=w.layout)
        per[name] = per.get(name, 0.0) + time.perf_counter() - t
    return time.perf_counter() - t_all, per


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--m", type=int, default=1, help="tokens per call (decode batch size)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--layouts", nargs="+", default=["plain", "interleaved"])
    args = ap.parse_args(argv)
    if not quant_ops.available():
        raise SystemExit(f"quantized kernels unavailable: {quant_ops.reason()}")
    plain = step_weights(args.layers)
    variants = {"plain": plain}
    if "interleaved" in args.layouts:
        variants["interleaved"] = [(n, kernel_layout(w, "x16")) for n, w in plain]
    variants = {k: v for k, v in variants.items() if k in args.layouts}
    nbytes = sum(w.nbytes for _, w in plain)
    shape_bytes: dict[str, int] = {}
    for n, w in plain:
        shape_bytes[n] = shape_bytes.get(n, 0) + w.nbytes
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    print(f"isa {quant_ops.best_isa()}; step weights {nbytes / 1e6:.1f} MB; M={args.m}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        best: dict[str, tuple[float, dict[str, float]]] = {}
        bw = 0.0
        for _ in range(args.rounds):
            t = time.perf_counter()
            buf.sum()
            bw = max(bw, nbytes / (time.perf_counter() - t))
            for name, ws in variants.items():
                total, per = time_step(ws, args.m)
                if name not in best or total < best[name][0]:
                    best[name] = (total, per)
        print(f"threads={threads}: torch.sum read bandwidth {bw / 1e9:.1f} GB/s (best round)")
        for name, (total, per) in best.items():
            shapes = ", ".join(f"{n} {shape_bytes[n] / s / 1e9:.1f}" for n, s in per.items())
            gbs = nbytes / total / 1e9
            print(
                f"  {name:12s} {1000 * total:6.2f} ms/step  {gbs:5.1f} GB/s = "
                f"{100 * gbs * 1e9 / bw:3.0f} % of torch.sum  (GB/s by shape: {shapes})"
            )


if __name__ == "__main__":
    main()
