"""``kvserve bench prefix``: shared-prefix and multi-turn traces with the prefix cache on / off.

Reports prefix_hit_rate, TTFT and throughput for each trace and setting, on fresh engines,
next to the ideal hit rate the trace allows (:func:`ideal_hit_rate`) and the TTFT speed-up.
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

from kvserve.bench.offline import run_trace
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


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def ideal_hit_rate(prompts: list[list[int]], block_size: int | None = None) -> float:
    """The prefix hit rate an unbounded cache could reach on ``prompts`` in this order.

    Each prompt can reuse its longest common prefix with any *earlier* prompt, capped at
    ``len - 1`` (one token must be computed to sample from). With ``block_size`` the reuse is
    rounded down to whole blocks and, as the engine does, a prompt that would be fully
    cached gives up its last block (``KVCacheManager.get_computed_blocks``). Returns reused
    prompt tokens / all prompt tokens (0.0 for an empty trace).
    """
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    total = sum(len(p) for p in prompts)
    if total == 0:
        return 0.0
    reused = 0
    for i, prompt in enumerate(prompts):
        best = max((_common_prefix_len(prompt, prev) for prev in prompts[:i]), default=0)
        if block_size is None:
            best = min(best, len(prompt) - 1)
        else:
            best = best // block_size * block_size
            if best >= len(prompt):  # NOTE: fully cached: the last block is recomputed
                best -= block_size
        reused += max(best, 0)
    return reused / total


def cmd_prefix(args: argparse.Namespace) -> int:
    """Run each trace with the prefix cache on and off; print one row per run."""
    rows: list[dict[str, Any]] = []
    print(
        f"{'workload':<14} {'cache':>5} {'hit_rate':>9} {'ttft_mean_ms':>13} "
        f"{'ttft_p90_ms':>12} {'out_tok/s':>10} {'tot_tok/s':>10}"
    )
    summaries: list[str] = []
    for kind in args.workloads:
        trace = make_trace(kind, args)
        prompts = [list(r.prompt_token_ids or []) for r in trace]
        ideal = ideal_hit_rate(prompts)
        ideal_blocks = ideal_hit_rate(prompts, args.block_size)
        ttft_on = 0.0
        for enabled in (True, False):
            engine = build_engine(args, enable_prefix_caching=enabled)
            run = run_trace(
                engine,
                trace,
                warmup=args.warmup,
                ignore_eos=args.ignore_eos,
                temperature=args.sampling_temperature,
            )
            f = run.figures
            rows.append(
                {
                    "workload": kind,
                    "enable_prefix_caching": enabled,
                    "ideal_hit_rate": ideal,
                    "ideal_hit_rate_block_aligned": ideal_blocks,
                    **f,
                }
            )
            print(
                f"{kind:<14} {'on' if enabled else 'off':>5} {f['prefix_hit_rate']:>9.3f} "
                f"{f['ttft']['mean'] * 1e3:>13.1f} {f['ttft']['p90'] * 1e3:>12.1f} "
                f"{f['output_tokens_per_s']:>10.1f} {f['total_tokens_per_s']:>10.1f}",
                flush=True,
            )
            if enabled:
                ttft_on = f["ttft"]["mean"]
            elif ttft_on > 0:
                rows[-1]["ttft_mean_off_over_on"] = f["ttft"]["mean"] / ttft_on
                hit = rows[-2]["prefix_hit_rate"]
                speedup = rows[-1]["ttft_mean_off_over_on"]
                summaries.append(
                    f"{kind}: hit rate {hit:.3f} vs ideal {ideal:.3f} "
                    f"({(ideal - hit) * 100:+.1f} points short; block-aligned ideal "
                    f"{ideal_blocks:.3f}); mean TTFT off/on {speedup:.2f}x"
                )
            del engine
            gc.collect()
    for line in summaries:
        print(line)
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
