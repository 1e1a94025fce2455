"""``kvserve bench prefix``: shared-prefix and multi-turn traces with the prefix cache on / off.

Reports prefix_hit_rate, TTFT and throughput for each trace and setting, on fresh engines.
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

from kvserve.bench.offline import run_offline, warm_up
from kvserve.bench.report import make_record, write_json
from kvserve.bench.throughput import add_run_args, build_engine
from kvserve.bench.workload_args import finalize
from kvserve.sim.workloads import DEFAULT_VOCAB_SIZE, WorkloadRequest, generate_workload


def register(sub: argparse._SubParsersAction, engine_parser: Any) -> None:
    """Add ``bench prefix``."""
    p = engine_parser(sub, "prefix", "prefix cache on vs off on shared-prefix / multi-turn traces")
    g = p.add_argument_group("traces")
    g.add_argument(
        "--workloads",
        nargs="+",
        choices=["shared-prefix", "multi-turn"],
        default=["shared-prefix", "multi-turn"],
    )
    g.add_argument("--num-prompts", type=int, default=16)
    g.add_argument("--num-groups", type=int, default=2, help="shared-prefix: groups")
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: prefix tokens")
    g.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: question tokens")
    g.add_argument("--output-len", type=int, default=16, help="output tokens per request")
    g.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per chat")
    g.add_argument("--system-prompt-len", type=int, default=128, help="multi-turn: system tokens")
    g.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    g.add_argument("--workload-seed", type=int, default=0)
    add_run_args(p)
    p.set_defaults(func=cmd_prefix)


def make_trace(kind: str, args: argparse.Namespace) -> list[WorkloadRequest]:
    """The trace of ``kind`` from the flags, with resolved prompt ids."""
    if kind == "shared-prefix":
        reqs = generate_workload(
            kind,
            args.num_prompts,
            args.workload_seed,
            vocab_size=args.vocab_size,
            num_groups=args.num_groups,
            prefix_len=args.prefix_len,
            suffix_len=args.suffix_len,
            output_len=args.output_len,
        )
    else:
        # NOTE: turns keep their scripted reply lengths short so the trace stays small; the
        # engine generates its own replies, so only prompt blocks can hit across turns.
        reqs = generate_workload(
            kind,
            args.num_prompts,
            args.workload_seed,
            vocab_size=args.vocab_size,
            num_turns=args.num_turns,
            system_prompt_len=args.system_prompt_len,
            user_median=32.0,
            reply_median=float(args.output_len),
            reply_sigma=0.0,
            think_time=0.0,
            max_turn_len=max(args.output_len, 64),
        )
    return finalize(reqs, args.vocab_size)


def cmd_prefix(args: argparse.Namespace) -> int:
    """Run each trace with the prefix cache on and off; print one row per run."""
    rows: list[dict[str, Any]] = []
    print(
        f"{'workload':<14} {'cache':>5} {'hit_rate':>9} {'ttft_mean_ms':>13} "
        f"{'ttft_p90_ms':>12} {'out_tok/s':>10} {'tot_tok/s':>10}"
    )
    for kind in args.workloads:
        trace = make_trace(kind, args)
        for enabled in (True, False):
            engine = build_engine(args, enable_prefix_caching=enabled)
            if args.warmup:
                warm_up(engine)
            run = run_offline(
                engine, trace, ignore_eos=args.ignore_eos, temperature=args.sampling_temperature
            )
            f = run.figures
            rows.append({"workload": kind, "enable_prefix_caching": enabled, **f})
            print(
                f"{kind:<14} {'on' if enabled else 'off':>5} {f['prefix_hit_rate']:>9.3f} "
                f"{f['ttft']['mean'] * 1e3:>13.1f} {f['ttft']['p90'] * 1e3:>12.1f} "
                f"{f['output_tokens_per_s']:>10.1f} {f['total_tokens_per_s']:>10.1f}",
                flush=True,
            )
            del engine
            gc.collect()
    write_json(
        args.output_json,
        make_record(
            "prefix",
            rows,
            mode="offline",
            label=args.label,
            settings={
                k: getattr(args, k)
                for k in (
                    "num_prompts",
                    "num_groups",
                    "prefix_len",
                    "suffix_len",
                    "output_len",
                    "num_turns",
                    "system_prompt_len",
                    "workload_seed",
                )
            },
        ),
    )
    return 0
