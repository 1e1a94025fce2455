"""A real run's decode attention, replayed: every step's kernel rows over cold layer caches.

    # 1. record the lengths of the rows each step sends through the decode kernel
    PYTHONPATH=. .venv/bin/python bench/probes/attn_replay.py record LENS.json -- \\
        bench throughput --workload-file W --num-prompts 64 --max-num-seqs 32 --num-threads 2
    # 2. replay them (run it from two trees with PYTHONPATH=TREE to compare kernels)
    PYTHONPATH=. .venv/bin/python bench/probes/attn_replay.py replay LENS.json \\
        [--threads 2] [--layers 30] [--passes 2]
    # or summarise them: the K/V a step reads, and how evenly two ways of splitting the
    # kernel's tasks share it among the threads (no kernel runs)
    .venv/bin/python bench/probes/attn_replay.py split LENS.json [--threads 2]

``record`` runs a ``kvserve`` command in this process with ``NativeCPUBackend``'s per-step
plan wrapped: each step's ``lens`` (its decode rows, then the rows of the prompt chunks that
run through the kernel) and its number of decode rows go to LENS.json. ``replay`` runs each
recorded step's ``paged_decode_attention`` once per layer over ``--layers`` caches in one
huge-page pool (the embedded model's shape: 9 query heads, 3 kv heads, head_dim 64, bf16,
block size 16; block tables shuffled as a long-running pool's are, the rows of one prompt
chunk sharing their sequence's table), so the K/V come from DRAM as they do between the
model's weight reads. Printed: the total ms over all steps and layers (best of
``--passes``), and ms per step at each batch-size band. ``split`` prints the steps' mean
decode rows, positions and bf16 K/V bytes (the embedded model's shape, 30 layers), and the
share of the threads' capacity (positions read over threads x the busiest thread's, summed
over the steps) with the tasks split evenly by count (``at::parallel_for``, before session
18) and by positions (``balanced_bounds`` in kvserve_cpu_ops.cpp, the tasks as it makes them).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
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


KV_BYTES_PER_POSITION = 30 * 2 * KV_HEADS * HEAD_DIM * 2  # 30 layers, K and V, bf16
TASK_OVERHEAD_POSITIONS = 16  # kTaskOverheadPositions in kvserve_cpu_ops.cpp


def busiest_by_count(work: list[int], threads: int) -> int:
    """The busiest thread's work when ``at::parallel_for`` splits the tasks by count."""
    chunk = -(-len(work) // min(threads, len(work)))
    return max(sum(work[i : i + chunk]) for i in range(0, len(work), chunk))


def busiest_by_work(work: list[int], threads: int) -> int:
    """The busiest thread's work under ``balanced_bounds`` (the boundary nearest each
    p / parts of the work, never before the previous one)."""
    parts = max(1, min(threads, len(work)))
    prefix = list(itertools.accumulate(work, initial=0))
    bounds = [0]
    for p in range(1, parts):
        goal = prefix[-1] * p
        i = bisect.bisect_left(prefix, -(-goal // parts), lo=bounds[-1])
        if i > bounds[-1] and goal - parts * prefix[i - 1] < parts * prefix[i] - goal:
            i -= 1
        bounds.append(min(len(work), i))
    bounds.append(len(work))
    return max(prefix[b] - prefix[a] for a, b in itertools.pairwise(bounds))


def split(path: str, threads: int) -> None:
    """Summarise a record: K/V read per step and the two splits' share of the threads."""
    with open(path) as f:
        steps: list[dict[str, Any]] = json.load(f)
    decodes = [step["lens"][: step["decodes"]] for step in steps]
    positions = sum(sum(d) for d in decodes) / len(steps)
    print(
        f"{len(steps)} steps: {sum(len(d) for d in decodes) / len(steps):.1f} decode rows, "
        f"{positions:.0f} positions, {positions * KV_BYTES_PER_POSITION / 1e6:.1f} MB of K/V "
        "a step (decode rows)"
    )
    total = old = new = 0
    for step in steps:
        seq = [n + TASK_OVERHEAD_POSITIONS for n in step["lens"]]  # no window: all visible
        per_head = [n for n in seq for _ in range(KV_HEADS)]
        # before: heads as tasks below 2 sequences a thread; now also when one sequence holds
        # more than a thread's share
        old_tasks = per_head if len(seq) < 2 * threads else seq
        whole = len(seq) >= 2 * threads and max(seq) * threads <= sum(seq)
        new_tasks = seq if whole else per_head
        total += sum(seq)
        old += threads * busiest_by_count(old_tasks, threads) * len(seq) // len(old_tasks)
        new += threads * busiest_by_work(new_tasks, threads) * len(seq) // len(new_tasks)
    print(
        f"share of {threads} threads' capacity: split by count {100 * total / old:.1f} %, "
        f"by positions {100 * total / new:.1f} %"
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
    spl = sub.add_parser("split")
    spl.add_argument("path")
    spl.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.cmd == "record":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        record(args.path, command)
    elif args.cmd == "split":
        split(args.path, args.threads)
    else:
        replay(args.path, args.threads, args.layers, args.passes)


if __name__ == "__main__":
    main()
