"""The AMX prefill attention kernel against torch's SDPA on one layer's prefill chunk.

    PYTHONPATH=. .venv/bin/python bench/probes/amx_prefill_attn.py [--threads 1 2]

The embedded model's attention shape (9 query heads over 3 KV heads, head_dim 64, bf16, block
size 16): a chunk of n rows after ctx cached tokens, for (n, ctx) in (128, 0), (512, 0),
(512, 512), (2048, 0). ``kvserve::amx_prefill_attention`` reads the paged cache; SDPA gets the
contiguous K/V it would gather (no gather timed) and is_causal, or the [n, ctx + n] mask when
there is a context. Best of 10 calls each; GFLOP/s counts the causal products only.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.runtime.native.backend import amx_prefill_available

CASES = ((128, 0), (512, 0), (512, 512), (2048, 0))
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def best_of(fn: Callable[[], object], calls: int = 10) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def time_case(n: int, ctx: int, gen: torch.Generator) -> tuple[float, float]:
    """Seconds of one call, (the AMX kernel, SDPA), for a chunk of n rows after ctx tokens."""
    length = ctx + n
    blocks = -(-length // BLOCK)
    cache = torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    table = torch.arange(blocks, dtype=torch.int32)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen).bfloat16()  # [n, H, d]
    out = torch.empty_like(q)
    k = cache[0].reshape(-1, KV_HEADS, HEAD_DIM)[:length].transpose(0, 1)[None]  # [1, kvh, L, d]
    v = cache[1].reshape(-1, KV_HEADS, HEAD_DIM)[:length].transpose(0, 1)[None]
    mask = None
    if ctx:
        hidden = torch.arange(length)[None] > (ctx + torch.arange(n))[:, None]
        mask = torch.zeros(n, length).masked_fill(hidden, float("-inf")).bfloat16()
    scale = 1 / math.sqrt(HEAD_DIM)
    amx = best_of(lambda: torch.ops.kvserve.amx_prefill_attention(out, q, cache, table, ctx, scale))
    sdpa = best_of(
        lambda: F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
        )
    )
    return amx, sdpa


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    if not amx_prefill_available():
        raise SystemExit("the AMX prefill kernel does not run here")
    gen = torch.Generator().manual_seed(0)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for n, ctx in CASES:
            amx, sdpa = time_case(n, ctx, gen)
            flop = 4 * HEADS * HEAD_DIM * (n * ctx + n * (n + 1) / 2)
            print(
                f"threads {threads} n={n:5d} ctx={ctx:4d}: AMX {amx * 1e6:8.1f} us "
                f"({flop / amx / 1e9:4.0f} GFLOP/s), SDPA {sdpa * 1e6:8.1f} us "
                f"({flop / sdpa / 1e9:4.0f} GFLOP/s), {sdpa / amx:.2f}x"
            )


if __name__ == "__main__":
    main()
