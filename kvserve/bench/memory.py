"""``kvserve bench memory``: the activation plan and the start-up budget, one figure a line.

    kvserve bench memory [--model PATH] [--batched-tokens 1 32 512 2048] [--max-num-seqs 64]
        [--max-model-len 2048] [--memory-budget 1.5GiB] [--dtype float32] [--max-layers N]
        [--measure]

For each token budget (``max_num_batched_tokens``): planned activation peak (the arena of
the interval packer), naive sum (every intermediate its own buffer), lower bound (most bytes
live at once) and eager peak (PyTorch's own frees), for the largest step the scheduler may
issue. Then the budget breakdown at the last token budget. ``--measure`` also runs that
largest step for real on the CPU (zero weights, nothing loaded) and reports the growth of
the process's peak RSS during it, next to the plan; and runs a small engine in a fresh
process to measure the framework footprint that ``HEADROOM_BYTES`` covers.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import time

import torch

from kvserve.config import ModelArchConfig
from kvserve.engine_config import EngineConfig, parse_bytes
from kvserve.memory_budget import (
    HEADROOM_BYTES,
    LOAD_HEADROOM_BYTES,
    load_peak_bytes,
    model_weights_bytes,
    plan_kv_blocks,
    plan_step_activations,
)
from kvserve.models.loader import resolve_model
from kvserve.runtime.memory_plan import ActivationPlan, describe, worst_case_steps

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _arch(model: str | None) -> ModelArchConfig:
    """The model's shapes without loading its weights."""
    path = resolve_model(model)
    if os.path.isdir(path):
        from kvserve.models.hf_loader import hf_arch_config, read_hf_config

        return hf_arch_config(read_hf_config(path), path)
    from kvserve.models.gguf_loader import gguf_arch_config
    from kvserve.models.gguf_reader import read_gguf

    return gguf_arch_config(read_gguf(path))


def _read_status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def measure_step_rss(
    arch: ModelArchConfig, plan: ActivationPlan, config: EngineConfig, max_model_len: int
) -> int | None:
    """Peak RSS growth (bytes) while running ``plan``'s step for real on the CPU.

    Zero weights and a KV cache of one max-length table, built before the measurement.
    Returns None where the peak cannot be reset (``/proc/self/clear_refs``).
    """
    from kvserve.models.llama import LlamaForCausalLM
    from kvserve.runtime.model_runner import ModelRunner

    steps = worst_case_steps(
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        block_size=config.block_size,
    )
    sched = steps[plan.step_name]
    dtype = _DTYPES[config.dtype]
    num_blocks = -(-max_model_len // config.block_size)
    layers = plan.num_layers_traced
    traced_arch = dataclasses.replace(arch, num_hidden_layers=layers)
    model = LlamaForCausalLM(traced_arch, dtype=dtype)
    for p in model.parameters():
        p.data.zero_()
    runner = ModelRunner(
        model, traced_arch, num_blocks=num_blocks, block_size=config.block_size, dtype=dtype
    )
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset VmHWM to the current RSS
    except OSError:
        return None
    before = _read_status("VmRSS")
    runner.execute(sched)
    return _read_status("VmHWM") - before


_FOOTPRINT_SCRIPT = """
import json, sys
from kvserve import LLM, SamplingParams
from kvserve.memory_budget import plan_step_activations
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
llm = LLM(model=sys.argv[1] or None, num_kv_blocks=int(sys.argv[2]), max_model_len=1024,
          max_num_seqs=8, max_num_batched_tokens=128, num_threads=2)
eng = llm.engine
plan = plan_step_activations(eng.config, eng.arch, max_model_len=eng.max_model_len)
load_peak = status("VmHWM")
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
prompts = [[100 + 7 * i + j for j in range(60 + 30 * i)] for i in range(8)]
llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True),
             use_tqdm=False)
rep = eng.memory_report
print(json.dumps({"load_peak": load_peak, "run_peak": status("VmHWM"),
                  "weights": rep.weights_bytes, "kv": rep.kv_cache_bytes,
                  "activations": plan.reserve_bytes}))
"""


def measure_framework(model: str | None, num_kv_blocks: int = 64) -> dict[str, int]:
    """Run a small engine in a fresh process; returns its measured footprints in bytes.

    ``load_overhead``: peak RSS while starting minus the weights twice (the loader's copy
    and the model's). ``framework``: peak RSS while generating minus weights, KV pool and
    the planned activation reserve: what ``HEADROOM_BYTES`` must cover.
    """
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", _FOOTPRINT_SCRIPT, model or "", str(num_kv_blocks)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": root},
        check=True,
    )
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "load_overhead": got["load_peak"] - 2 * got["weights"],
        "framework": got["run_peak"] - got["weights"] - got["kv"] - got["activations"],
        **got,
    }


def main(argv: list[str] | None = None) -> int:
    """Print the activation plans and the budget breakdown; returns the exit status."""
    p = argparse.ArgumentParser(prog="kvserve bench memory", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded)")
    p.add_argument("--batched-tokens", type=int, nargs="+", default=[1, 32, 512, 2048])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--memory-budget", type=parse_bytes, default=parse_bytes("1.5GiB"))
    p.add_argument(
        "--max-layers", type=int, default=None, help="trace only this many layers (default all)"
    )
    p.add_argument("--measure", action="store_true", help="run each largest step for real")
    args = p.parse_args(argv)

    arch = _arch(args.model)
    max_model_len = min(args.max_model_len, arch.max_position_embeddings)
    print(
        f"model: {arch.architecture}, {arch.num_hidden_layers} layers, hidden "
        f"{arch.hidden_size}, vocab {arch.vocab_size}, dtype {args.dtype}"
    )
    config = None
    plan = None
    for num_tokens in args.batched_tokens:
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            block_size=args.block_size,
            max_num_batched_tokens=num_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=max_model_len,
            memory_budget=args.memory_budget,
        )
        t0 = time.perf_counter()
        plan = plan_step_activations(
            config, arch, max_model_len=max_model_len, max_layers=args.max_layers
        )
        seconds = time.perf_counter() - t0
        print(
            f"max_num_batched_tokens={num_tokens} max_num_seqs={args.max_num_seqs} "
            f"max_model_len={max_model_len}:"
        )
        for line in describe(plan):
            print(f"  {line}")
        for name, peak in plan.peaks_by_step.items():
            print(f"  planned peak of the {name} step: {peak} bytes")
        print(f"  planning time: {seconds:.2f} s")
        if args.measure:
            measured = measure_step_rss(arch, plan, config, max_model_len)
            if measured is None:
                print("  measured activation peak: unavailable (no /proc/self/clear_refs)")
            else:
                print(f"  measured activation peak (RSS growth in one step): {measured} bytes")
    assert config is not None and plan is not None
    weights = model_weights_bytes(arch, _DTYPES[args.dtype])
    kv_per_token = arch.kv_bytes_per_token(torch.tensor([], dtype=_DTYPES[args.dtype]).itemsize)
    print(f"budget breakdown at max_num_batched_tokens={config.max_num_batched_tokens}:")
    try:
        rep = plan_kv_blocks(
            config,
            arch,
            weights_bytes=weights,
            kv_bytes_per_token=kv_per_token,
            max_model_len=max_model_len,
            activation_plan=plan,
        )
    except ValueError as e:
        print(f"  does not fit: {e}")
        return 1
    for line in rep.lines(typical_len=min(512, max_model_len)):
        print(f"  {line}")
    print(f"  load peak (load headroom + weights twice): {load_peak_bytes(weights)} bytes")
    if args.measure:
        got = measure_framework(args.model)
        print(
            f"measured load overhead (peak RSS loading - 2 x weights): {got['load_overhead']} bytes"
        )
        print(
            "measured framework footprint (peak RSS generating - weights - KV - activations): "
            f"{got['framework']} bytes"
        )
        print(f"headroom constant: {HEADROOM_BYTES} bytes; load headroom: {LOAD_HEADROOM_BYTES}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
