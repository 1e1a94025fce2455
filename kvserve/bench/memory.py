"""``kvserve bench memory``: the activation plan and the start-up budget, one figure a line.

    kvserve bench memory [--model PATH] [--batched-tokens 1 32 512 2048] [--max-num-seqs 64]
        [--max-model-len 2048] [--memory-budget 1.5GiB] [--dtype float32] [--max-layers N]
        [--measure]

For each token budget (``max_num_batched_tokens``): planned activation peak (the arena of
the interval packer), naive sum (every intermediate its own buffer), lower bound (most bytes
live at once), eager peak (PyTorch's own frees) and the modelled kernel scratch inside them
(CPU flash attention's per-thread buffers), for the largest step the scheduler may issue.
Then the budget breakdown at the last token budget, with the GEMM library's kernel scratch
measured by running the plan's GEMM shapes once. ``--measure`` also runs each largest step
for real on the CPU in a fresh process (zero weights, nothing loaded): the GEMM probe, then
the growth of the peak RSS during the step, next to the plan; and runs a small engine in a
fresh process to measure the framework footprint that ``HEADROOM_BYTES`` covers.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch

from kvserve.config import ModelArchConfig
from kvserve.engine.config import EngineConfig, parse_bytes
from kvserve.engine.memory_budget import (
    HEADROOM_BYTES,
    LOAD_HEADROOM_BYTES,
    load_peak_bytes,
    model_weights_bytes,
    plan_kv_blocks,
    plan_step_activations,
)
from kvserve.models.loader import resolve_model
from kvserve.runtime.kernel_scratch import measure_gemm_scratch
from kvserve.runtime.memory_plan.planner import ActivationPlan, describe

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


_STEP_SCRIPT = """
import dataclasses, gc, json, sys
import torch
from kvserve.bench.memory import _arch, _read_status
from kvserve.models.llama import LlamaForCausalLM
from kvserve.runtime.kernel_scratch import GemmShape, measure_gemm_scratch
from kvserve.runtime.memory_plan.planner import worst_case_steps
from kvserve.runtime.model_runner import ModelRunner
a = json.loads(sys.argv[1])
torch.set_num_threads(a["num_threads"])
dtype = getattr(torch, a["dtype"])
arch = _arch(a["model"]).with_num_layers(a["layers"])
model = LlamaForCausalLM(arch, dtype=dtype)
for p in model.parameters():
    p.data.zero_()
num_blocks = -(-a["max_model_len"] // a["block_size"])
runner = ModelRunner(model, arch, num_blocks=num_blocks, block_size=a["block_size"], dtype=dtype)
# Warm-up: one small step of each kind, so one-time initialisation (thread pools, first-use
# kernels and allocations, which the headroom covers) is not counted against the step.
warm = ModelRunner(model, arch, num_blocks=8, block_size=a["block_size"], dtype=dtype)
for small in worst_case_steps(max_num_batched_tokens=16, max_num_seqs=2, max_model_len=64,
                              block_size=a["block_size"]).values():
    warm.execute(small)
del warm
shapes = [GemmShape(*s) for s in a["gemm_shapes"]]
gemm = measure_gemm_scratch(shapes, b_operands=[p.t() for p in model.parameters() if p.dim() == 2])
sched = worst_case_steps(max_num_batched_tokens=a["tokens"], max_num_seqs=a["seqs"],
                         max_model_len=a["max_model_len"], block_size=a["block_size"])[a["step"]]
gc.collect()
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # reset VmHWM to the current RSS
before = _read_status("VmRSS")
runner.execute(sched)
print(json.dumps({"gemm_scratch": gemm, "step_growth": _read_status("VmHWM") - before}))
"""


def measure_step_rss(
    model: str | None,
    plan: ActivationPlan,
    config: EngineConfig,
    max_model_len: int,
) -> dict[str, int] | None:
    """Run ``plan``'s step for real on the CPU in a fresh process; returns what it measured.

    Zero weights (``plan.num_layers_traced`` layers) and a KV cache of one max-length table;
    a small warm-up step of each kind first. ``gemm_scratch``: what running the plan's GEMM
    shapes once then added to the process (the start-up probe,
    ``kernel_scratch.measure_gemm_scratch``); ``step_growth``: the peak RSS growth while the
    step then runs, to compare with ``plan.reserve_bytes``. None where the peak cannot be
    reset (no writable ``/proc/self/clear_refs``). Heap reuse makes the growth noisy; with
    glibc's ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072`` (inherited) RSS follows
    the live bytes closely.
    """
    import json
    import subprocess
    import sys

    if not os.access("/proc/self/clear_refs", os.W_OK):
        return None
    args = {
        "model": model,
        "dtype": config.dtype,
        "layers": plan.num_layers_traced,
        "block_size": config.block_size,
        "max_model_len": max_model_len,
        "tokens": config.max_num_batched_tokens,
        "seqs": config.max_num_seqs,
        "step": plan.step_name,
        "num_threads": plan.num_threads,
        "gemm_shapes": [dataclasses.astuple(s) for s in plan.gemm_shapes],
    }
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", _STEP_SCRIPT, json.dumps(args)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": root},
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


_FOOTPRINT_SCRIPT = """
import json, sys
from kvserve import LLM, SamplingParams
from kvserve.engine.memory_budget import plan_step_activations
from kvserve.runtime.kernel_scratch import measure_gemm_scratch
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
llm = LLM(model=sys.argv[1] or None, num_kv_blocks=int(sys.argv[2]), max_model_len=1024,
          max_num_seqs=8, max_num_batched_tokens=128, num_threads=2)
eng = llm.engine
plan = plan_step_activations(eng.config, eng.arch, max_model_len=eng.max_model_len)
weights = [p.t() for p in eng.runner.model.parameters() if p.dim() == 2]
scratch = measure_gemm_scratch(plan.gemm_shapes, b_operands=weights) or 0  # no GEMM ran yet
load_peak = status("VmHWM")
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
prompts = [[100 + 7 * i + j for j in range(60 + 30 * i)] for i in range(8)]
llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True),
             use_tqdm=False)
rep = eng.memory_report
print(json.dumps({"load_peak": load_peak, "run_peak": status("VmHWM"),
                  "weights": rep.weights_bytes, "kv": rep.kv_cache_bytes,
                  "activations": plan.reserve_bytes, "kernel_scratch": scratch}))
"""


def measure_framework(model: str | None, num_kv_blocks: int = 64) -> dict[str, int]:
    """Run a small engine in a fresh process; returns its measured footprints in bytes.

    ``load_overhead``: peak RSS while starting minus the weights twice (the loader's copy
    and the model's). ``framework``: peak RSS while generating minus weights, KV pool, the
    planned activation reserve and the measured kernel scratch: what ``HEADROOM_BYTES``
    must cover.
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
        "framework": got["run_peak"]
        - got["weights"]
        - got["kv"]
        - got["activations"]
        - got["kernel_scratch"],
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
            measured = measure_step_rss(args.model, plan, config, max_model_len)
            if measured is None:
                print("  measured activation peak: unavailable (no /proc/self/clear_refs)")
            else:
                gemm, growth = measured["gemm_scratch"], measured["step_growth"]
                print(f"  measured kernel scratch (GEMM library, after a warm-up): {gemm} bytes")
                print(
                    f"  measured activation peak (RSS growth in the step, after both): {growth} "
                    f"bytes ({growth / plan.reserve_bytes:.3f} x the activation reserve)"
                )
    assert config is not None and plan is not None
    # NOTE: this process has run no GEMM yet, so the probe sees what a fresh engine would
    # (except that its B operands are temporaries here, allocated before the reading).
    kernel_scratch = measure_gemm_scratch(plan.gemm_shapes) or 0
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
            kernel_scratch_bytes=kernel_scratch,
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
            "measured framework footprint (peak RSS generating - weights - KV - activations "
            "- kernel scratch): "
            f"{got['framework']} bytes"
        )
        print(f"headroom constant: {HEADROOM_BYTES} bytes; load headroom: {LOAD_HEADROOM_BYTES}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
