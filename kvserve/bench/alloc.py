"""Micro-benchmark of the memory core: what block allocation and prefix matching cost.

Figures, all in microseconds:

- ``pool_alloc_free_us_per_block``: ``BlockPool.allocate`` + ``free`` (the O(1) free list).
- ``alloc_free_us_per_block``: ``KVCacheManager.allocate_slots`` for a whole fresh prompt
  (prefix caching on, so every full block is also inserted into the radix tree, and the
  pool evicts old cached blocks once it is full) + ``free``.
- ``decode_alloc_us_per_token``: ``allocate_slots(request, 1)`` once per decoded token.
- ``prefix_match_us_per_block``: ``get_computed_blocks`` on a fully cached prompt.

Run: ``python -m kvserve.bench.alloc`` (or ``kvserve bench alloc``).
"""

from __future__ import annotations

import argparse
import time

from kvserve.core.kv.block_pool import BlockPool
from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

_PARAMS = SamplingParams(max_tokens=None)


def run_alloc_bench(
    num_blocks: int = 4096,
    block_size: int = 16,
    blocks_per_request: int = 64,
    num_rounds: int = 200,
) -> dict[str, float | int]:
    """Time the allocation and prefix-match paths; returns figures by name (see module)."""
    if blocks_per_request > num_blocks:
        raise ValueError("blocks_per_request must not exceed num_blocks")
    if min(num_blocks, block_size, blocks_per_request, num_rounds) < 1:
        raise ValueError("all bench sizes must be >= 1")
    n, bs = blocks_per_request, block_size
    out: dict[str, float | int] = {
        "num_blocks": num_blocks,
        "block_size": bs,
        "blocks_per_request": n,
        "num_rounds": num_rounds,
    }

    pool = BlockPool(num_blocks)
    t0 = time.perf_counter()
    for _ in range(num_rounds):
        pool.free(reversed(pool.allocate(n)))
    out["pool_alloc_free_us_per_block"] = _us(time.perf_counter() - t0, num_rounds * n)

    # Distinct prompts (so every round inserts n fresh blocks into the tree) built up front.
    kv = KVCacheManager(num_blocks, bs)
    reqs = [
        Request(f"a{r}", list(range(r * n * bs, (r + 1) * n * bs)), _PARAMS)
        for r in range(num_rounds)
    ]
    t0 = time.perf_counter()
    for req in reqs:
        kv.allocate_slots(req, n * bs)
        req.num_computed_tokens = n * bs
        kv.free(req)
    out["alloc_free_us_per_block"] = _us(time.perf_counter() - t0, num_rounds * n)
    out["evictions"] = kv.snapshot()["prefix_cache_evictions"]

    req = Request("decode", [1], _PARAMS)
    kv.allocate_slots(req, 1)
    req.num_computed_tokens = 1
    num_decode = min(n * bs, (num_blocks - 1) * bs)
    t0 = time.perf_counter()
    for i in range(num_decode):
        req.output_token_ids.append(i)
        kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    out["decode_alloc_us_per_token"] = _us(time.perf_counter() - t0, num_decode)
    kv.free(req)

    # A fully cached prompt; one extra token so the cap keeps every block.
    prompt = list(range(7, 7 + n * bs))
    warm = Request("warm", prompt, _PARAMS)
    kv.allocate_slots(warm, len(prompt))
    warm.num_computed_tokens = len(prompt)
    probe = Request("probe", prompt + [0], _PARAMS)
    t0 = time.perf_counter()
    for _ in range(num_rounds):
        ids, _num_hit = kv.get_computed_blocks(probe)
    out["prefix_match_us_per_block"] = _us(time.perf_counter() - t0, num_rounds * len(ids))
    kv.free(warm)
    kv.check_integrity()
    return out


def _us(seconds: float, count: int) -> float:
    return seconds * 1e6 / max(count, 1)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: ``kvserve bench alloc [--num-blocks N] [--block-size B] ...``."""
    parser = argparse.ArgumentParser(prog="kvserve bench alloc", description=__doc__)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks-per-request", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args(argv)
    figures = run_alloc_bench(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        blocks_per_request=args.blocks_per_request,
        num_rounds=args.rounds,
    )
    for name, value in figures.items():
        print(f"{name:32s} {value:.3f}" if isinstance(value, float) else f"{name:32s} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
