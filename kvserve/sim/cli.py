"""``kvserve simulate``: capacity planning on a modelled GPU with the real scheduler.

The lead's ``kvserve/cli.py`` calls :func:`add_parser` on its sub-parsers and :func:`run`
with the parsed arguments.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvserve.config import SchedulerConfig
from kvserve.engine.config import parse_bytes
from kvserve.sim.calibrate import fit_efficiency, load_step_records, save_step_records
from kvserve.sim.cost_model import Efficiency
from kvserve.sim.experiments import EXPERIMENTS, run_experiment
from kvserve.sim.hardware import HARDWARE, GiB, get_hardware
from kvserve.sim.report import Cell, format_table
from kvserve.sim.setup import SimSetup
from kvserve.sim.simulator import simulate
from kvserve.sim.specs import PRESETS, get_model_spec
from kvserve.sim.workloads import KINDS, generate_workload, load_jsonl, save_jsonl

DEFAULT_EFF = Efficiency()


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``simulate`` sub-command on an argparse ``add_subparsers()`` object."""
    p = subparsers.add_parser(
        "simulate",
        help="simulate the real scheduler + KV cache manager on a modelled GPU",
        description=(
            "Drive kvserve's scheduler and KV cache manager with a roofline cost model "
            "instead of a model: capacity planning for hardware and models not at hand. "
            f"Models: {', '.join(PRESETS)} or a config.json path. GPUs: {', '.join(HARDWARE)}."
        ),
    )
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``simulate`` flags (separate so a standalone parser can reuse them)."""
    g = p.add_argument_group("deployment")
    g.add_argument("--model", default="llama-3-8b", help="preset name or HF config.json path")
    g.add_argument("--dtype", default=None, help="weight dtype (default: preset / config)")
    g.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: --dtype)")
    g.add_argument("--gpu", default="h100", help="h100, h200, a100, cpu (this machine)")
    g.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="tensor parallel degree (GPUs)"
    )
    # NOTE: the spelling before the engine's; kept, hidden, for old scripts.
    g.add_argument("--tp", dest="tensor_parallel_size", type=int, help=argparse.SUPPRESS)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--eff-flops", type=float, default=DEFAULT_EFF.flops)
    g.add_argument("--eff-bandwidth", type=float, default=DEFAULT_EFF.bandwidth)
    g.add_argument("--overhead-ms", type=float, default=DEFAULT_EFF.overhead_s * 1e3)
    e = p.add_argument_group("engine")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-kv-blocks", type=int, default=None, help="override the KV pool size")
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    e.add_argument(
        "--swap-space",
        type=parse_bytes,
        default=16 * GiB,
        help="host tier per GPU for swap preemption, in bytes as the engine's flag (suffixes "
        "K, M, G, KiB, MiB, GiB accepted; default 16GiB)",
    )
    # NOTE: the spelling before the engine's (a float of GiB); kept, hidden, for old scripts.
    e.add_argument("--swap-space-gib", type=float, default=None, help=argparse.SUPPRESS)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument(
        "--prefill-share",
        type=float,
        default=SchedulerConfig.prefill_share,
        help="the engine's fair prefill share (1: a chunk may take the whole step budget)",
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--experiment",
        choices=[*EXPERIMENTS, "all"],
        default=None,
        help="run a canned experiment (table + PNG) instead of a single replay",
    )
    w.add_argument("--workload", default=None, help="JSONL trace to replay")
    w.add_argument("--workload-kind", choices=KINDS, default="sharegpt")
    w.add_argument("--num-requests", type=int, default=None)
    w.add_argument("--request-rate", type=float, default=None, help="req/s (default: all at t=0)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--save-workload", default=None, help="write the generated trace as JSONL")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="sim_out", help="directory for PNG plots")
    o.add_argument(
        "--calibrate",
        default=None,
        metavar="STEPS.jsonl",
        help="fit efficiency factors to measured step records and report the fit error",
    )
    o.add_argument(
        "--measure",
        default=None,
        metavar="STEPS.jsonl",
        help="time the real engine (embedded model, this machine) on a calibration trace, "
        "write its step records here, then fit them (use with --model smollm2-135m --gpu cpu)",
    )


def build_setup(args: argparse.Namespace) -> SimSetup:
    """A SimSetup from parsed ``simulate`` arguments (ValueError on bad values)."""
    model = get_model_spec(args.model)
    if args.dtype or args.kv_dtype:
        model = model.with_dtype(args.dtype or model.dtype, args.kv_dtype)
    return SimSetup(
        model=model,
        hardware=get_hardware(args.gpu),
        tp=args.tensor_parallel_size,
        efficiency=Efficiency(args.eff_flops, args.eff_bandwidth, args.overhead_ms / 1e3),
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks,
        swap_space_gib=(
            args.swap_space / GiB if args.swap_space_gib is None else args.swap_space_gib
        ),
        preemption_mode=args.preemption_mode,
        prefill_share=args.prefill_share,
        enable_prefix_caching=not args.no_prefix_caching,
        num_requests=args.num_requests,
        request_rate=args.request_rate,
        seed=args.seed,
    )


def _replay(setup: SimSetup, args: argparse.Namespace) -> str:
    if args.workload:
        wl = load_jsonl(args.workload)
        source = args.workload
    else:
        n = setup.num_requests or 1000
        rate = setup.rate()
        if args.workload_kind == "sharegpt":
            wl = setup.sharegpt(n, rate)
        else:
            wl = generate_workload(
                args.workload_kind,
                n,
                setup.seed,
                request_rate=rate,
                vocab_size=setup.model.vocab_size,
            )
        source = f"{args.workload_kind} x {n} (seed {setup.seed}, rate {rate:g} req/s)"
    if args.save_workload:
        save_jsonl(args.save_workload, wl)
    res = simulate(
        wl,
        setup.sched_config(),
        setup.cost_model(),
        setup.num_blocks(),
        setup.block_size,
        enable_prefix_caching=setup.enable_prefix_caching,
        num_host_blocks=setup.memory_plan().num_host_blocks if setup.num_kv_blocks is None else 0,
        vocab_size=setup.model.vocab_size,
        kv_sample_every=4,
    )
    s = res.summary()
    rows: list[list[Cell]] = [
        [k, int(v) if float(v).is_integer() and abs(v) < 1e15 else v] for k, v in s.items()
    ]
    for rid, why in list(res.rejected.items())[:5]:
        rows.append([f"rejected {rid}", why])
    return f"## replay of {source}\n\n" + format_table(["figure", "value"], rows)


def _calibrate(setup: SimSetup, path: str) -> str:
    records = load_step_records(path)
    fit = fit_efficiency(records, setup.cost_model())
    e = fit.efficiency
    return (
        f"## calibration on {path}\n\n{fit.summary()}\n"
        f"use: --eff-flops {e.flops:.4f} --eff-bandwidth {e.bandwidth:.4f} "
        f"--overhead-ms {e.overhead_s * 1e3:.4f}"
    )


def run(args: argparse.Namespace) -> int:
    """Run ``kvserve simulate``; prints the KV header, then tables. Returns the exit code."""
    try:
        setup = build_setup(args)
        for line in setup.header_lines():
            print(line)
        print()
        if args.measure:
            from kvserve.sim.measure import calibration_workload, measure_engine_steps

            wl = calibration_workload(setup.num_requests or 24, setup.seed)
            save_step_records(args.measure, measure_engine_steps(wl))
            print(f"wrote {args.measure}")
        if args.calibrate or args.measure:
            print(_calibrate(setup, args.calibrate or args.measure))
            return 0
        if args.experiment:
            names = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
            for name in names:
                t0 = time.perf_counter()
                res = run_experiment(name, setup, args.out)
                print(res.text())
                print(f"(simulated in {time.perf_counter() - t0:.1f} s wall)\n")
            return 0
        print(_replay(setup, args))
        return 0
    except (ValueError, OSError) as e:
        print(f"kvserve simulate: error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: ``python -m kvserve.sim.cli --model ... --experiment ...``."""
    parser = argparse.ArgumentParser(prog="kvserve simulate")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
