"""``kvserve bench startup``: warm start to the first token, against ``import torch``.

Each run times, in fresh processes, ``python -c "import torch"`` and ``kvserve generate
PROMPT --max-tokens 1`` (wall clock, process start to exit), and reads the engine's own
"ready in" from the generate's start-up line. One untimed generate first (``--warmup``)
builds the native kernels and fills the kernel-selection cache, so the runs are warm starts.
The report gives the medians and the ratio generate / import torch (issue 48's target: at
most 4x).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

from kvserve.bench.report import make_record, write_json

TARGET_RATIO = 4.0
_READY = re.compile(r"\| ready in (\d+(?:\.\d+)?) s")


def register(sub: argparse._SubParsersAction, engine_parser: Any) -> None:
    """Add ``bench startup`` (engine flags go to the timed ``kvserve generate``)."""
    help_ = "warm start to the first token vs import torch (median of fresh processes)"
    p = engine_parser(sub, "startup", help_)
    p.description = (
        "Time `kvserve generate PROMPT --max-tokens 1` and `python -c 'import torch'` in fresh "
        "processes, after one untimed warm-up generate (native kernels built, kernel choice "
        "cached); report the medians and their ratio. Engine flags (--model, --dtype, ...) "
        "go to the timed generate."
    )
    p.add_argument("--runs", type=int, default=5, help="timed runs (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed generate runs first (default 1)")
    p.add_argument("--prompt", default="Hi", help="the prompt (default 'Hi')")
    p.add_argument("--output-json", default=None, help="write the result record here")
    p.set_defaults(func=cmd_startup)


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags given on the command line (those that differ from the defaults),
    passed on to the timed ``kvserve generate``."""
    from kvserve.engine.config import EngineConfig

    defaults = EngineConfig()
    out: list[str] = []
    for name, value in vars(EngineConfig.from_cli_args(args)).items():
        if value == getattr(defaults, name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def generate_command(args: argparse.Namespace) -> list[str]:
    """The timed command: ``python -m kvserve.cli generate PROMPT --max-tokens 1 ...``."""
    return [
        sys.executable,
        "-m",
        "kvserve.cli",
        "generate",
        args.prompt,
        "--max-tokens",
        "1",
        *engine_flags(args),
    ]


def timed(command: list[str]) -> tuple[float, str]:
    """Run ``command`` to completion: (wall seconds, stderr). RuntimeError if it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command[:5])} ... exited with {proc.returncode}: {proc.stderr[-2000:]}"
        )
    return seconds, proc.stderr


def run_startup(args: argparse.Namespace) -> dict[str, Any]:
    """The figures: medians (seconds) of ``--runs`` fresh processes each, and the ratio."""
    gen = generate_command(args)
    torch_cmd = [sys.executable, "-c", "import torch"]
    first = [timed(gen)[0] for _ in range(args.warmup)]
    torch_s, gen_s, ready_s = [], [], []
    for _ in range(args.runs):
        torch_s.append(timed(torch_cmd)[0])
        seconds, err = timed(gen)
        gen_s.append(seconds)
        match = _READY.search(err)
        if match:
            ready_s.append(float(match.group(1)))
    import_torch = statistics.median(torch_s)
    generate = statistics.median(gen_s)
    ratio = generate / import_torch
    return {
        "runs": args.runs,
        "import_torch_s": import_torch,
        "generate_first_token_s": generate,
        "engine_ready_s": statistics.median(ready_s) if ready_s else None,
        "ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "within_target": ratio <= TARGET_RATIO,
        "warmup_s": first,
        "import_torch_runs_s": torch_s,
        "generate_runs_s": gen_s,
        "generate_command": gen[1:],
    }


def format_report(fig: dict[str, Any]) -> str:
    """The plain-text report."""
    ready = fig["engine_ready_s"]
    lines = [
        f"## warm start to the first token ({fig['runs']} runs, medians)",
        "",
        f"import torch:                     {fig['import_torch_s']:.2f} s",
        f"kvserve generate --max-tokens 1:  {fig['generate_first_token_s']:.2f} s"
        + (f" (engine ready in {ready:.2f} s)" if ready is not None else ""),
        f"ratio:                            {fig['ratio']:.2f}x (target <= "
        f"{fig['target_ratio']:.0f}x: {'met' if fig['within_target'] else 'NOT met'})",
        "command: python " + " ".join(fig["generate_command"]),
    ]
    return "\n".join(lines)


def cmd_startup(args: argparse.Namespace) -> int:
    """Run the benchmark, print the report, write the record."""
    if args.runs < 1:
        raise ValueError(f"--runs must be >= 1, got {args.runs}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    fig = run_startup(args)
    print(format_report(fig))
    write_json(args.output_json, make_record("startup", fig, mode="offline"))
    return 0
