"""A real run's decode attention, replayed: every step's kernel rows over cold layer caches.

    # 1. record the lengths of the rows each step sends through the decode kernel
    PYTHONPATH=. .venv/bin/python bench/probes/attn_replay.py record LENS.json -- \\
        bench throughput --workload-file W --num-prompts 64 --max-num-seqs 32 --num-threads 2
    # 2. replay them (run it from two trees with PYTHONPATH=TREE to compare kernels)
    PYTHONPATH=. .venv/bin/python bench/probes/attn_replay.py replay LENS.json \\
        [--threads 2] [--layers 30] [--passes 2]

``record`` runs a ``kvserve`` command in this process with ``NativeCPUBackend``'s per-step
plan wrapped: each step's ``lens`` (its decode rows, then the rows of the prompt chunks that
run through the kernel) and its number of decode rows go to LENS.json. ``replay`` runs each
recorded step's ``paged_decode_attention`` once per layer over ``--layers`` caches in one
huge-page pool (the embedded model's shape: 9 query heads, 3 kv heads, head_dim 64, bf16,
block size 16; block tables shuffled as a long-running pool's are, the rows of one prompt
chunk sharing their sequence's table), so the K/V come from DRAM as they do between the
model's weight reads. Printed: the total ms over all steps and layers (best of
``--passes``), and ms per step at each batch-size band.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import torch

BLOCK, KV_HEADS, HEAD_DIM, HEADS = 16, 3, 64, 9


def record(path: str, command: list[str]) -> None:
    """Run ``kvserve COMMAND`` here and write each step's kernel row lengths to ``path``."""
    from kvserve.cli import main as kvserve_main
    from kvserve.runtime.native import backend

    steps: list[dict[str, Any]] = []
    original = backend._KernelRows.of.__func__  # type: ignore[attr-defined]

    def of(cls: type, meta: Any, limit: int) -> Any:
        plan = original(cls, meta, limit)
        # NOTE: the memory plan traces a step with FakeTensors, whose values cannot be read.
        if plan.lens is not None and not isinstance(plan.lens, torch._subclasses.FakeTensor):
            steps.append({"decodes": meta.num_decode_seqs, "lens": plan.lens.tolist()})
        return plan

    backend._KernelRows.of = classmethod(of)  # type: ignore[method-assign,assignment]
    try:
        kvserve_main(command)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    with open(path, "w") as f:
        json.dump(steps, f)
    print(f"{len(steps)} steps recorded to {path}", file=sys.stderr)


def sequences(step: dict[str, Any]) -> list[int]:
    """Each kernel row's sequence index: a decode row is its own; the rows of a prompt chunk
    (each one position past the one before) share one."""
    lens: list[int] = step["lens"]
    decodes = min(step["decodes"], len(lens))
    seq, next_seq = list(range(decodes)), decodes
    for i in range(decodes, len(lens)):
        if i > decodes and lens[i] == lens[i - 1] + 1:  # the chunk goes on
            seq.append(seq[-1])
        else:
            seq.append(next_seq)
            next_seq += 1
    return seq


def replay(path: str, threads: int, layers: int, passes: int) -> None:
    """Time every recorded step's attention over ``layers`` cold caches."""
    from kvserve.runtime import native
    from kvserve.runtime.huge_pages import zeros_huge

    if not native.available():
        raise SystemExit(f"no native kernels: {native.reason()}")
    ops = native.ops()
    with open(path) as f:
        steps: list[dict[str, Any]] = json.load(f)
    torch.set_num_threads(threads)
    width = max(math.ceil(n / BLOCK) for step in steps for n in step["lens"])
    rows = max(len(step["lens"]) for step in steps)
    seqs = max(max(sequences(step)) + 1 for step in steps)
    num_blocks = seqs * width
    shape = (2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    pool = zeros_huge((layers, *shape), torch.bfloat16, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for cache in pool.unbind(0):
        cache.copy_(torch.randn(shape, generator=gen))
    seq_tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).reshape(seqs, width)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)  # [rows, H, d]
    out = torch.empty_like(q)
    caches = pool.unbind(0)
    args = []
    for step in steps:
        n = len(step["lens"])
        tables = seq_tables[torch.tensor(sequences(step))].contiguous()  # [n, width]
        args.append((torch.tensor(step["lens"], dtype=torch.int32), tables, q[:n], out[:n]))
    scale = 1 / math.sqrt(HEAD_DIM)
    best: list[float] | None = None
    for _ in range(passes):
        times = []
        for lens_t, tab, qs, os_ in args:
            t = time.perf_counter()
            for cache in caches:
                ops.paged_decode_attention(os_, qs, cache, tab, lens_t, scale, 0, 0)
            times.append(time.perf_counter() - t)
        if best is None or sum(times) < sum(best):
            best = times
    assert best is not None
    print(
        f"{len(steps)} steps, {layers} layers, {threads} threads: {1000 * sum(best):.0f} ms in all"
    )
    for lo, hi in ((1, 1), (2, 8), (9, 32), (33, 128), (129, 1 << 30)):
        sel = [t for t, step in zip(best, steps, strict=True) if lo <= len(step["lens"]) <= hi]
        if sel:
            print(
                f"  rows {lo}-{hi if hi < 1 << 30 else 'more'}: {len(sel)} steps, "
                f"{1000 * sum(sel) / len(sel):.2f} ms a step, {1000 * sum(sel):.0f} ms"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("path")
    rec.add_argument("command", nargs=argparse.REMAINDER)
    rep = sub.add_parser("replay")
    rep.add_argument("path")
    rep.add_argument("--threads", type=int, default=2)
    rep.add_argument("--layers", type=int, default=30)
    rep.add_argument("--passes", type=int, default=2)
    args = ap.parse_args()
    if args.cmd == "record":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        record(args.path, command)
    else:
        replay(args.path, args.threads, args.layers, args.passes)


if __name__ == "__main__":
    main()
