"""``kvserve bench capacity``: concurrency, KV use and preemption across KV pools and allocators.

Every point of the grid (KV pool x block size x allocator x max_num_seqs) runs the trace offline
on a fresh engine; its row reports max_concurrent_requests, kv_usage peak, kv_utilization,
preemptions (count, per 1,000 scheduled requests, recomputed tokens) and throughput, and keeps
the run's per-step timeline for ``bench plot``.

The pool is given either as block counts (``--kv-blocks``) or as a token budget
(``--kv-budget-tokens N``: ``N // block_size`` blocks, the same memory at every block size),
which is what the allocator comparison and the block-size sweep need:

- ``--allocators paged contiguous``: paged blocks on demand vs one contiguous run per request
  sized for prompt + max_tokens (``core/contiguous.py``); the paged/contiguous ratio of
  max_concurrent_requests is printed for each pool, block size and max_num_seqs.
- ``--block-sizes 1 4 8 16 32 64``: kv_utilization (less waste in partly filled last blocks)
  against throughput (fewer, larger blocks to gather) at each size.
- ``--max-tokens N``: every request asks for N tokens and is ended at its trace length as if
  it had sampled EOS (``run_offline``); without it max_tokens is the trace's own output
  length, so the contiguous allocator reserves exactly what each request will use (its best
  case).
"""

from __future__ import annotations

import argparse
import gc
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.bench.offline import run_trace
from kvserve.bench.report import make_record, write_json
from kvserve.bench.throughput import add_run_args, build_engine
from kvserve.bench.workload_args import (
    add_workload_args,
    build_workload,
    check_vocab,
    workload_meta,
)
from kvserve.sim.workloads import WorkloadRequest

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

ALLOCATORS = ("paged", "contiguous")

COLUMNS = (
    ("kv_allocator", "allocator", "{}"),
    ("block_size", "block", "{:d}"),
    ("num_kv_blocks", "blocks", "{:d}"),
    ("max_num_seqs", "max_seqs", "{:d}"),
    ("max_concurrent_requests", "peak_run", "{:d}"),
    ("mean_running_requests", "mean_run", "{:.1f}"),
    ("kv_usage_peak", "usage_pk", "{:.3f}"),
    ("kv_utilization", "util", "{:.3f}"),
    ("preemptions", "preempt", "{:d}"),
    ("preemptions_per_1k_scheduled", "pre/1k", "{:.1f}"),
    ("recomputed_tokens_wasted", "recomp_tok", "{:d}"),
    ("output_tokens_per_s", "out_tok/s", "{:.1f}"),
)


@dataclass(frozen=True)
class SweepPoint:
    """One engine configuration of the sweep."""

    kv_allocator: str
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    kv_budget_tokens: int | None = None  # set when the pool came from --kv-budget-tokens


def register(sub: argparse._SubParsersAction, engine_parser: Any) -> None:
    """Add ``bench capacity``."""
    p = engine_parser(
        sub,
        "capacity",
        "sweep KV pool x block size x allocator x max_num_seqs: concurrency, utilization, "
        "preemption, throughput",
    )
    pool = p.add_mutually_exclusive_group(required=True)
    pool.add_argument(
        "--kv-blocks", type=int, nargs="+", help="pool sizes to try (blocks), e.g. 32 64 128"
    )
    pool.add_argument(
        "--kv-budget-tokens",
        type=int,
        nargs="+",
        help="pool sizes to try as token budgets: num_kv_blocks = N // block_size, so every "
        "block size and allocator gets the same KV memory (N x kv_bytes_per_token)",
    )
    p.add_argument(
        "--allocators",
        nargs="+",
        choices=ALLOCATORS,
        default=None,
        help="KV allocators to compare (default: the --kv-allocator flag)",
    )
    p.add_argument(
        "--block-sizes",
        type=int,
        nargs="+",
        default=None,
        help="block sizes to sweep, e.g. 1 4 8 16 32 64 (default: the --block-size flag)",
    )
    p.add_argument(
        "--max-num-seqs-list",
        type=int,
        nargs="+",
        default=None,
        help="max_num_seqs values to try (default: the --max-num-seqs flag)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="max_tokens every request asks for; each still ends at its trace output length, "
        "as if it sampled EOS (default: the trace's output length, the contiguous "
        "allocator's best case)",
    )
    p.add_argument(
        "--step-thread",
        action="store_true",
        help="step the engine on a worker thread (as the server does), as in bench throughput",
    )
    add_workload_args(p, num_prompts=16)
    add_run_args(p)
    p.set_defaults(func=cmd_capacity)


def sweep_points(kv_blocks: list[int], max_seqs: list[int]) -> list[tuple[int, int]]:
    """The (num_kv_blocks, max_num_seqs) grid, in order; ValueError on a non-positive value."""
    for v in (*kv_blocks, *max_seqs):
        if v < 1:
            raise ValueError(f"sweep values must be >= 1, got {v}")
    return list(itertools.product(kv_blocks, max_seqs))


def sweep_grid(
    *,
    allocators: list[str],
    block_sizes: list[int],
    max_seqs: list[int],
    kv_blocks: list[int] | None = None,
    kv_budget_tokens: list[int] | None = None,
) -> list[SweepPoint]:
    """Every (pool, block size, max_num_seqs, allocator) point, allocators innermost.

    Exactly one of ``kv_blocks`` and ``kv_budget_tokens`` must be given. A token budget
    becomes ``budget // block_size`` blocks; ValueError if that is 0, on a non-positive
    value, or on an unknown allocator.
    """
    if (kv_blocks is None) == (kv_budget_tokens is None):
        raise ValueError("give exactly one of kv_blocks and kv_budget_tokens")
    for a in allocators:
        if a not in ALLOCATORS:
            raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}, got {a!r}")
    pools = kv_blocks if kv_blocks is not None else kv_budget_tokens
    assert pools is not None
    for v in (*pools, *block_sizes, *max_seqs):
        if v < 1:
            raise ValueError(f"sweep values must be >= 1, got {v}")
    points = []
    for pool, bs, seqs, alloc in itertools.product(pools, block_sizes, max_seqs, allocators):
        if kv_budget_tokens is None:
            points.append(SweepPoint(alloc, bs, pool, seqs))
            continue
        if pool // bs < 1:
            raise ValueError(f"--kv-budget-tokens {pool} holds no block of {bs} tokens")
        points.append(SweepPoint(alloc, bs, pool // bs, seqs, kv_budget_tokens=pool))
    return points


def allocator_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """paged / contiguous max_concurrent_requests for every pool both allocators ran."""
    by_key: dict[tuple, dict[str, dict[str, Any]]] = {}
    for row in rows:
        if "error" in row:
            continue
        key = (row["kv_budget_tokens"], row["num_kv_blocks"], row["block_size"])
        by_key.setdefault((*key, row["max_num_seqs"]), {})[row["kv_allocator"]] = row
    out = []
    for (budget, blocks, bs, seqs), pair in by_key.items():
        paged, contiguous = pair.get("paged"), pair.get("contiguous")
        if paged is None or contiguous is None:
            continue
        p, c = paged["max_concurrent_requests"], contiguous["max_concurrent_requests"]
        pm, cm = paged["mean_running_requests"], contiguous["mean_running_requests"]
        out.append(
            {
                "kv_budget_tokens": budget,
                "num_kv_blocks": blocks,
                "block_size": bs,
                "max_num_seqs": seqs,
                "paged_max_concurrent_requests": p,
                "contiguous_max_concurrent_requests": c,
                "concurrency_ratio": p / c if c else None,
                "paged_mean_running_requests": pm,
                "contiguous_mean_running_requests": cm,
                "mean_concurrency_ratio": pm / cm if cm else None,
                "paged_kv_utilization": paged["kv_utilization"],
                "contiguous_kv_utilization": contiguous["kv_utilization"],
                "paged_capped_by_max_num_seqs": p >= seqs,
                # NOTE: then memory did not bind: the ratio is a lower bound.
                "paged_ran_every_request": p >= paged["num_requests"],
            }
        )
    return out


def format_table(rows: list[dict[str, Any]]) -> str:
    """The sweep as a fixed-width table."""
    header = " ".join(f"{title:>11}" for _, title, _ in COLUMNS)
    lines = [header]
    for row in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            v = row.get(key)
            cells.append(f"{'-' if v is None else fmt.format(v):>11}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def format_ratios(ratios: list[dict[str, Any]]) -> str:
    """One line per compared pool: paged vs contiguous max concurrency and utilization."""
    lines = []
    for r in ratios:
        pool = (
            f"budget {r['kv_budget_tokens']} tokens"
            if r["kv_budget_tokens"] is not None
            else f"{r['num_kv_blocks']} blocks"
        )
        ratio, mean_ratio = r["concurrency_ratio"], r["mean_concurrency_ratio"]
        capped = " (paged capped by max_num_seqs)" if r["paged_capped_by_max_num_seqs"] else ""
        if r["paged_ran_every_request"]:
            capped += " (paged ran every request at once: a lower bound)"
        lines.append(
            f"paged/contiguous max concurrency, {pool}, block {r['block_size']}, "
            f"max_num_seqs {r['max_num_seqs']}: {r['paged_max_concurrent_requests']} / "
            f"{r['contiguous_max_concurrent_requests']} = "
            f"{'-' if ratio is None else f'{ratio:.2f}x'}{capped}; mean running "
            f"{r['paged_mean_running_requests']:.1f} / {r['contiguous_mean_running_requests']:.1f}"
            f" = {'-' if mean_ratio is None else f'{mean_ratio:.2f}x'}; kv_utilization "
            f"{r['paged_kv_utilization']:.3f} vs {r['contiguous_kv_utilization']:.3f}"
        )
    return "\n".join(lines)


def run_point(
    args: argparse.Namespace, point: SweepPoint, requests: list[WorkloadRequest]
) -> dict[str, Any]:
    """One engine, one run of the trace: the row (with ``error`` if it could not run)."""
    row: dict[str, Any] = {
        "kv_allocator": point.kv_allocator,
        "block_size": point.block_size,
        "num_kv_blocks": point.num_kv_blocks,
        "max_num_seqs": point.max_num_seqs,
        "kv_budget_tokens": point.kv_budget_tokens,
    }
    try:
        # NOTE: inside the try: e.g. contiguous + --enable-host-prefix-cache is rejected, and
        # a request may need more blocks than the pool has.
        engine = build_engine(
            args,
            num_kv_blocks=point.num_kv_blocks,
            block_size=point.block_size,
            max_num_seqs=point.max_num_seqs,
            kv_allocator=point.kv_allocator,
        )
        row.update(_measure(args, engine, requests))
    except ValueError as e:
        row["error"] = str(e)
    gc.collect()  # NOTE: the engine's KV tensors go before the next point allocates its own
    return row


def _measure(
    args: argparse.Namespace, engine: LLMEngine, requests: list[WorkloadRequest]
) -> dict[str, Any]:
    """The trace through ``engine``: figures, KV budget in bytes, timeline, latencies."""
    check_vocab(requests, engine.arch.vocab_size)

    run = run_trace(
        engine,
        requests,
        warmup=args.warmup,
        step_thread=args.step_thread,
        ignore_eos=args.ignore_eos,
        temperature=args.sampling_temperature,
        max_tokens=args.max_tokens,
    )
    rep = engine.memory_report
    return {
        **run.figures,
        "num_kv_blocks": rep.num_kv_blocks,
        "kv_budget_bytes": rep.num_kv_blocks * engine.config.block_size * engine.kv_bytes_per_token,
        "timeline": run.timeline,
        "latency_samples": run.latency_samples,
    }


def cmd_capacity(args: argparse.Namespace) -> int:
    """Run the sweep; a point whose pool cannot hold one request is reported and skipped."""
    requests = build_workload(args)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    points = sweep_grid(
        allocators=args.allocators or [args.kv_allocator],
        block_sizes=args.block_sizes or [args.block_size],
        max_seqs=args.max_num_seqs_list or [args.max_num_seqs],
        kv_blocks=args.kv_blocks,
        kv_budget_tokens=args.kv_budget_tokens,
    )
    rows: list[dict[str, Any]] = []
    print(format_table([]), flush=True)
    for point in points:
        row = run_point(args, point, requests)
        rows.append(row)
        print(
            format_table([row]).splitlines()[-1]
            if "error" not in row
            else f"{point.kv_allocator} / block {point.block_size} / {point.num_kv_blocks} "
            f"blocks / {point.max_num_seqs} seqs: {row['error']}",
            flush=True,
        )
    print(format_table([r for r in rows if "error" not in r]))
    ratios = allocator_ratios(rows)
    if ratios:
        print(format_ratios(ratios))
    write_json(
        args.output_json,
        make_record(
            "capacity",
            rows,
            mode="offline",
            label=args.label,
            workload=workload_meta(args),
            block_size=args.block_size,
            max_tokens=args.max_tokens,
            step_thread=args.step_thread,
            ratios=ratios,
        ),
    )
    return 0
