"""A random-weight GGUF of SmolLM2-1.7B's shape in Q4_1, for decode past the last-level cache.

    PYTHONPATH=. .venv/bin/python bench/probes/past_l3_model.py OUT.gguf

The embedded SmolLM2-135M reads 96 MB of weights a decode step, which the AMX Xeon's 300 MB
L3 holds, so its B=1 decode runs above the bandwidth bound there (135 % on 2026-12-06 at 784f843) and
says nothing about a CPU with a 32 MB L3 (the EPYCs). This model (hidden 2048, 24 layers,
intermediate 8192, 32 heads, vocabulary 49152, tied embeddings: 1.7B weights, ~1 GB in Q4_1)
streams from DRAM on any of them; ``kvserve.bench.runtime_speed --model OUT.gguf`` then
measures the decode step against the bound on each kind's code paths (README, "Emulating
another CPU kind"). Built by ``tests.tiny_models.make_tiny_gguf`` (transformers' random init,
gguf's Q4_1); nothing downloaded. Takes a few minutes and ~14 GB of memory once.
"""

from __future__ import annotations

import argparse
import os
import time

from tests.tiny_models import make_tiny_gguf

SMOLLM2_1_7B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_theta": 130000.0,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the GGUF file to write (kept if it exists)")
    args = ap.parse_args()
    if os.path.exists(args.out):
        print(f"{args.out} exists")
        return
    t = time.perf_counter()
    path = make_tiny_gguf(
        os.path.dirname(os.path.abspath(args.out)),
        "smollm",
        tensor_type="Q4_1",
        name=os.path.basename(args.out),
        **SMOLLM2_1_7B,
    )
    size = os.path.getsize(path) / 1e9
    print(f"wrote {path}: {size:.2f} GB in {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
