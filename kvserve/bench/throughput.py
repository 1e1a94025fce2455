"""``kvserve bench throughput``: every request at once through the in-process engine.

Reports requests/s, output tokens/s, total tokens/s and the capacity figures of the run
(max_concurrent_requests, kv_usage peak, kv_utilization, prefix_hit_rate, preemptions). The
JSON record also keeps the per-step timeline (``timeline``) and per-request latencies
(``latency_samples``) that ``bench plot`` draws.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING, Any

from kvserve.bench.offline import call_in_worker_thread, run_trace
from kvserve.bench.report import make_record, print_figures, write_json
from kvserve.bench.workload_args import (
    add_workload_args,
    build_workload,
    check_vocab,
    workload_meta,
)
from kvserve.engine.config import EngineConfig

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine


def add_run_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by the offline commands."""
    g = p.add_argument_group("run")
    g.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="stop at EOS (default: ignore it so output lengths match the trace)",
    )
    g.add_argument("--sampling-temperature", type=float, default=0.0)
    g.add_argument("--no-warmup", dest="warmup", action="store_false")
    g.add_argument("--label", default=None, help="free-form label stored in the JSON record")
    g.add_argument("--output-json", default=None, help="write the result record here")


def register(sub: argparse._SubParsersAction, engine_parser: Any) -> None:
    """Add ``bench throughput``."""
    p = engine_parser(sub, "throughput", "offline throughput and capacity figures of a trace")
    add_workload_args(p)
    add_run_args(p)
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="keep at most this many requests in the engine (default: all)",
    )
    p.add_argument(
        "--replay-arrivals",
        action="store_true",
        help="queue requests at their trace arrival times instead of all at once",
    )
    p.add_argument(
        "--step-thread",
        action="store_true",
        help="step the engine on a worker thread (as the server does) instead of the main one",
    )
    p.set_defaults(func=cmd_throughput)


def build_engine(args: argparse.Namespace, **changes: Any) -> LLMEngine:
    """An engine from the engine flags (with ``changes``), its memory report on stderr.

    With ``--step-thread`` it is built on a worker thread too, as the server builds its
    engine on its engine thread (``async_engine.build_on_engine_thread`` says why).
    """
    from kvserve.engine.llm_engine import (
        LLMEngine,  # NOTE: lazy: torch import would slow `kvserve --help`
    )

    config = EngineConfig.from_cli_args(args).replace(**changes)
    if getattr(args, "step_thread", False):
        engine = call_in_worker_thread(lambda: LLMEngine(config))
    else:
        engine = LLMEngine(config)
    if not args.quiet:
        for line in engine.memory_report.lines():
            print(f"[kvserve] {line}", file=sys.stderr)
    return engine


def engine_meta(engine: LLMEngine) -> dict[str, Any]:
    """The engine settings stored with a result."""
    return {
        "model": engine.model_path,
        **dataclasses.asdict(engine.config),
        "num_kv_blocks": engine.memory_report.num_kv_blocks,
    }


def cmd_throughput(args: argparse.Namespace) -> int:
    """Run the trace offline and print / save the figures."""
    requests = build_workload(args)
    engine = build_engine(args)
    check_vocab(requests, engine.arch.vocab_size)

    run = run_trace(
        engine,
        requests,
        warmup=args.warmup,
        step_thread=args.step_thread,
        ignore_eos=args.ignore_eos,
        temperature=args.sampling_temperature,
        replay_arrivals=args.replay_arrivals,
        max_concurrency=args.max_concurrency,
    )
    title = f"kvserve throughput ({args.workload_file or args.workload}, {len(requests)} requests)"
    print_figures(run.figures, title)
    write_json(
        args.output_json,
        make_record(
            "throughput",
            run.figures,
            mode="offline, step thread" if args.step_thread else "offline",
            label=args.label,
            engine=engine_meta(engine),
            workload=workload_meta(args),
            max_concurrency=args.max_concurrency,
            step_thread=args.step_thread,
            timeline=run.timeline,
            latency_samples=run.latency_samples,
        ),
    )
    return 0
