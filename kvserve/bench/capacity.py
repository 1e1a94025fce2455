"""``kvserve bench capacity``: sweep the KV pool size and max_num_seqs on one trace.

For every (num_kv_blocks, max_num_seqs) point the trace runs offline on a fresh engine and
the row reports max_concurrent_requests, kv_usage peak, kv_utilization, preemptions (count,
per 1,000 scheduled requests, recomputed tokens) and throughput.
"""

from __future__ import annotations

import argparse
import gc
import itertools
from typing import Any

from kvserve.bench.offline import run_offline, warm_up
from kvserve.bench.report import make_record, write_json
from kvserve.bench.throughput import add_run_args, build_engine
from kvserve.bench.workload_args import (
    add_workload_args,
    build_workload,
    check_vocab,
    workload_meta,
)

COLUMNS = (
    ("num_kv_blocks", "blocks", "{:d}"),
    ("max_num_seqs", "max_seqs", "{:d}"),
    ("max_concurrent_requests", "peak_run", "{:d}"),
    ("kv_usage_peak", "usage_pk", "{:.3f}"),
    ("kv_utilization", "util", "{:.3f}"),
    ("preemptions", "preempt", "{:d}"),
    ("preemptions_per_1k_scheduled", "pre/1k", "{:.1f}"),
    ("recomputed_tokens_wasted", "recomp_tok", "{:d}"),
    ("output_tokens_per_s", "out_tok/s", "{:.1f}"),
)


def register(sub: argparse._SubParsersAction, engine_parser: Any) -> None:
    """Add ``bench capacity``."""
    p = engine_parser(sub, "capacity", "sweep KV pool size x max_num_seqs: concurrency, preemption")
    p.add_argument(
        "--kv-blocks",
        type=int,
        nargs="+",
        required=True,
        help="pool sizes to try (blocks), e.g. 32 64 128",
    )
    p.add_argument(
        "--max-num-seqs-list",
        type=int,
        nargs="+",
        default=None,
        help="max_num_seqs values to try (default: the --max-num-seqs flag)",
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


def cmd_capacity(args: argparse.Namespace) -> int:
    """Run the sweep; a point whose pool cannot hold one request is reported and skipped."""
    requests = build_workload(args)
    points = sweep_points(args.kv_blocks, args.max_num_seqs_list or [args.max_num_seqs])
    rows: list[dict[str, Any]] = []
    for num_blocks, max_seqs in points:
        engine = build_engine(args, num_kv_blocks=num_blocks, max_num_seqs=max_seqs)
        check_vocab(requests, engine.arch.vocab_size)
        row: dict[str, Any] = {"num_kv_blocks": num_blocks, "max_num_seqs": max_seqs}
        try:
            if args.warmup:
                warm_up(engine)
            run = run_offline(
                engine, requests, ignore_eos=args.ignore_eos, temperature=args.sampling_temperature
            )
            row.update(run.figures)
            row["num_kv_blocks"] = num_blocks
        except ValueError as e:  # NOTE: e.g. one request needs more blocks than the pool has
            row["error"] = str(e)
        rows.append(row)
        print(
            format_table([row]).splitlines()[-1]
            if "error" not in row
            else f"{num_blocks} blocks / {max_seqs} seqs: {row['error']}",
            flush=True,
        )
        del engine
        gc.collect()
    print(format_table([r for r in rows if "error" not in r]))
    write_json(
        args.output_json,
        make_record(
            "capacity",
            rows,
            mode="offline",
            label=args.label,
            workload=workload_meta(args),
            block_size=args.block_size,
        ),
    )
    return 0
