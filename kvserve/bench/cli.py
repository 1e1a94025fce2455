"""``kvserve bench ...``: registers the benchmark sub-commands with the kvserve CLI (the
help a user sees is ``DESCRIPTION`` and each sub-command's own)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

from kvserve.bench import capacity, prefix, serve, spec, startup, throughput
from kvserve.bench.workload_args import add_workload_args, build_workload

EngineParser = Callable[[argparse._SubParsersAction, str, str], argparse.ArgumentParser]

# Benchmarks owned by other modules, wired in when they expose ``main(argv)``.
_EXTERNAL = (
    ("alloc", "kvserve.bench.alloc", "block allocation micro-benchmark"),
    ("runtime-speed", "kvserve.bench.runtime_speed", "decode speed of the bare model runner"),
    ("memory", "kvserve.bench.memory", "activation plan and memory budget"),
    ("hotpath", "kvserve.bench.hotpath", "allocations per steady-state decode step"),
    ("kernels", "kvserve.bench.kernels", "projection kernel candidates x M bucket, chosen"),
    ("accuracy", "kvserve.bench.accuracy", "KV quantization and windowed eviction accuracy"),
    ("router", "kvserve.bench.router", "prefix-aware vs round-robin routing over local replicas"),
    ("itl-report", "kvserve.bench.itl_report", "tables of the step-time budget runs"),
    ("soak", "kvserve.bench.soak", "mixed requests with injected faults against one server"),
    ("structured", "kvserve.bench.structured", "structured output overhead and validity"),
    ("tp", "kvserve.bench.tp", "tensor parallel vs one process: logits, agreement, step time"),
    ("first-token", "kvserve.bench.first_token", "greedy answer and top log-probs per setting"),
    ("long-prompt", "kvserve.bench.long_prompt", "a short request's wait beside a long prefill"),
    ("stall", "kvserve.bench.stall", "issue 51's stall targets, step-budget settings alternated"),
)


DESCRIPTION = """\
Measure kvserve on this machine. Each benchmark prints its figures; most also write a JSON
record (--output-json) that `kvserve bench plot` draws side by side.

Start with:
  kvserve bench startup                  time to the first token vs `import torch`
  kvserve bench throughput               offline tokens/s of a synthetic trace
  kvserve serve & kvserve bench serve    latency (TTFT, ITL) and goodput of a server
  kvserve bench capacity --kv-blocks 64 128
                                         concurrency and preemption per KV pool size

Every benchmark takes --help."""


def register(sub: argparse._SubParsersAction, engine_parser: EngineParser) -> None:
    """Add ``bench`` and its sub-commands to the ``kvserve`` parser."""
    p = sub.add_parser(
        "bench",
        help="benchmarks: throughput, serving latency, capacity, start-up, kernels, ...",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_sub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    startup.register(bench_sub, engine_parser)
    throughput.register(bench_sub, engine_parser)
    serve.register(bench_sub, engine_parser)
    capacity.register(bench_sub, engine_parser)
    prefix.register(bench_sub, engine_parser)
    spec.register(bench_sub, engine_parser)

    w = bench_sub.add_parser(
        "workload",
        help="generate a trace and save it as JSONL",
        description="Generate a request trace (the flags of bench throughput) and save it as "
        "JSONL (--save-workload), to replay it with --workload.",
    )
    add_workload_args(w)
    w.set_defaults(func=cmd_workload)

    pl = bench_sub.add_parser(
        "plot",
        help="plot result JSON files side by side (PNG)",
        description="Draw the PNGs (throughput, latency percentiles and CDFs, memory, "
        "capacity, prefix cache, goodput) that the given result records allow.",
    )
    pl.add_argument("results", nargs="+", help="result JSON files or folders of them")
    pl.add_argument("--out-dir", default="bench/out", help="where the PNGs go")
    pl.set_defaults(func=cmd_plot)

    for name, module, help_ in _EXTERNAL:
        _register_external(bench_sub, name, module, help_)


def cmd_workload(args: argparse.Namespace) -> int:
    """Write the trace (with resolved prompt ids) to --save-workload (required)."""
    if not args.save_workload:
        raise ValueError("bench workload needs --save-workload PATH")
    reqs = build_workload(args)
    num_tokens = sum(r.prompt_len for r in reqs)
    print(f"wrote {len(reqs)} requests ({num_tokens} prompt tokens) to {args.save_workload}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """Draw the side-by-side PNGs from result records."""
    from kvserve.bench.plots import load_records, plot_all  # NOTE: matplotlib is slow to import

    for path in plot_all(load_records(args.results), args.out_dir):
        print(path)
    return 0


def _register_external(
    bench_sub: argparse._SubParsersAction, name: str, module_name: str, help_: str
) -> None:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        return
    main = getattr(module, "main", None)
    if not callable(main):
        return
    # NOTE: prefix_chars="+" makes "-x" / "--flag" plain strings here, so every argument
    # (``--help`` included) reaches the module's own parser untouched.
    p = bench_sub.add_parser(name, help=help_, add_help=False, prefix_chars="+")
    p.add_argument("argv", nargs="*", help=f"arguments of {module_name}")
    p.set_defaults(func=lambda args: _run_external(main, args.argv))


def _run_external(main: Callable[[list[str]], Any], argv: list[str]) -> int:
    """Run a pass-through benchmark; its ``--log-level`` is taken out of its argv."""
    from kvserve.cli import configure_logging

    level, rest = pop_log_level(argv)
    if level is not None:
        configure_logging(level)
    result = main(rest)
    return int(result) if isinstance(result, int) else 0


def pop_log_level(argv: list[str]) -> tuple[str | None, list[str]]:
    """``(level, argv without it)`` for ``--log-level X`` / ``--log-level=X`` in ``argv``
    (the last one wins; None when absent). ValueError when the flag has no value."""
    level, rest = None, []
    it = iter(argv)
    for token in it:
        if token == "--log-level":
            level = next(it, None)
            if level is None:
                raise ValueError("--log-level needs a value (debug, info, warning, error)")
        elif token.startswith("--log-level="):
            level = token.split("=", 1)[1]
        else:
            rest.append(token)
    return (level.lower() if level is not None else None), rest
