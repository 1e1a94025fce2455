"""Paged decode attention on cold K/V: the read rate it reaches against ``torch.sum``.

    PYTHONPATH=. .venv/bin/python bench/probes/attn_cold.py [--threads 1 2] [--layers 48]
        [--dtype bfloat16 float32] [--batch 32] [--len 464] [--lens L1 L2 ...]

A B=32 decode batch of the embedded model's attention shape (9 query heads, 3 kv heads,
head_dim 64, bf16, block size 16), each sequence 464 tokens long (the ShareGPT trace's
median context; ``--dtype``, ``--batch`` and ``--len`` change these, each dtype in turn;
``--lens`` gives each sequence its own length, as a real step's batch has),
over ``--layers`` layer caches (48: ~550 MB in bf16, more than the L3 of any of this
project's CPUs, the Xeons' 480 MB and 260 MB included, so every layer's K/V comes from DRAM,
as in the model, where the weights stream between layers). Block tables either in random order
(a long-running server's free list) or sequential. With ``--huge-pages`` the caches are one
buffer in transparent huge pages, as the engine's KV pool is
(kvserve/runtime/huge_pages.py). Printed: us per layer call and GB/s of K/V read, next to
``torch.sum`` over the same bytes. Hot (``--layers 1``), the kernel's compute alone shows:
us per token per thread.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from kvserve.runtime import native
from kvserve.runtime.huge_pages import zeros_huge

BATCH, LEN, BLOCK, KV_HEADS, HEAD_DIM, HEADS = 32, 464, 16, 3, 64, 9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--huge-pages", action="store_true")
    ap.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--len", type=int, default=LEN)
    ap.add_argument(
        "--lens",
        type=int,
        nargs="+",
        help="each sequence's length (instead of --batch x --len), e.g. a recorded step's",
    )
    args = ap.parse_args()
    if not native.available():
        raise SystemExit(f"no native kernels: {native.reason()}")
    lens = args.lens or [args.len] * args.batch
    for dtype in args.dtype:
        print(f"== {dtype}, B={len(lens)}, {sum(lens)} tokens in all")
        run(args, getattr(torch, dtype), lens)


def run(args: argparse.Namespace, dtype: torch.dtype, seq_lens: list[int]) -> None:
    """Time the kernel over ``args.layers`` caches of sequences of ``seq_lens`` tokens."""
    ops = native.ops()
    batch = len(seq_lens)
    blocks = (max(seq_lens) + BLOCK - 1) // BLOCK  # table width; each sequence owns this many
    shape = (2, batch * blocks, BLOCK, KV_HEADS, HEAD_DIM)
    pool = torch.empty((args.layers, *shape), dtype=dtype)  # [layers, 2, blocks, ...]
    if args.huge_pages:
        pool = zeros_huge(tuple(pool.shape), dtype, torch.device("cpu"))
    caches = list(pool.unbind(0))
    for cache in caches:
        cache.copy_(torch.randn(shape))
    order = {
        "random blocks": torch.randperm(batch * blocks).to(torch.int32),
        "sequential blocks": torch.arange(batch * blocks, dtype=torch.int32),
    }
    lens = torch.tensor(seq_lens, dtype=torch.int32)  # [B]
    q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)  # [B, H, d]
    out = torch.empty_like(q)  # [B, H, d]
    kv_bytes = sum(seq_lens) * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize  # K and V read
    flat = torch.ones(kv_bytes * args.layers // 4)  # float32, the same bytes as the caches
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, ids in order.items():
            tables = ids.reshape(batch, blocks).contiguous()
            best = float("inf")
            for _ in range(args.passes):
                t = time.perf_counter()
                for cache in caches:
                    ops.paged_decode_attention(
                        out, q, cache, tables, lens, 1 / math.sqrt(HEAD_DIM), 0, 0
                    )
                best = min(best, (time.perf_counter() - t) / args.layers)
            per_token = best / sum(seq_lens) * threads * 1e9
            print(
                f"threads {threads}, {name}: {best * 1e6:.0f} us a layer, "
                f"{kv_bytes / best / 1e9:.1f} GB/s, {per_token:.0f} ns a token per thread"
            )
        flat.sum()
        t = time.perf_counter()
        flat.sum()
        rate = flat.nbytes / (time.perf_counter() - t) / 1e9
        print(f"threads {threads}, torch.sum over {flat.nbytes / 1e6:.0f} MB: {rate:.1f} GB/s")


if __name__ == "__main__":
    main()
