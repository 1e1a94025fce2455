"""Decode attention with its K/V warm (L2 and L3): us per call and ns per key row, one thread.

    PYTHONPATH=. .venv/bin/python bench/results/session21/attn_hot.py [LEN] [THREADS]

B=8 sequences of LEN tokens (default 128) in shuffled 16-token blocks, the embedded model's
attention shape (9 query heads, 3 KV heads, head_dim 64, bf16); best of 7 rounds of 200 calls.
Used for session 21's q . k-on-AMX experiment (attention_tried.txt).
"""

from __future__ import annotations

import sys
import time

import torch

from kvserve.runtime import native


def main() -> None:
    if not native.available():
        raise SystemExit(f"no native kernels: {native.reason()}")
    ops = native.ops()
    length = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    batch, block = 8, 16
    num_blocks = batch * length // block
    cache = torch.randn(2, num_blocks, block, 3, 64).bfloat16()  # [2, blocks, 16, kvh, d]
    q = torch.randn(batch, 9, 64).bfloat16()  # [B, H, d]
    tables = torch.randperm(num_blocks, dtype=torch.int32).view(batch, -1).contiguous()
    lens = torch.full((batch,), length, dtype=torch.int32)
    out = torch.empty_like(q)

    def call() -> None:
        ops.paged_decode_attention(out, q, cache, tables, lens, 0.125, 0, 0)

    for _ in range(50):
        call()
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(200):
            call()
        best = min(best, (time.perf_counter() - t0) / 200)
    print(f"{best * 1e6:.1f} us/call, {best * 1e9 / (batch * length):.1f} ns/token")


if __name__ == "__main__":
    main()
