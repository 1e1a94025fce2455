"""The quantized kernel selection of a GGUF model measured afresh, with its step checks: each
decode bucket's plans tried on whole steps' projections (``kvserve.runtime.plan_check``), ms a
step, and the one taken (``*``; plan 0 is the per-shape choice).

    PYTHONPATH=. .venv/bin/python bench/probes/step_check.py [--model GGUF] [--dtype bfloat16]
        [--threads 2] [--runs 1]

Each run measures again (``mode="measure"``: the cache is refreshed).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.engine_config import EngineConfig
from kvserve.kernel_setup import DTYPES
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import load_model
from kvserve.models.quant_select import (
    quantized_cache_key,
    quantized_counts,
    quantized_formats,
    select_quantized_kernels,
)
from kvserve.runtime.kernel_cache import cache_path
from kvserve.runtime.kernel_select import DECODE_BOUNDS, load_cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    loaded = load_model(args.model or EngineConfig().model, torch.float32, "auto")
    model = LlamaForCausalLM(loaded.arch)
    model.load_weights(loaded.state_dict)
    head = model.quantized.get("lm_head")
    key = quantized_cache_key(
        quantized_formats(model),
        act_dtype=dtype,
        device=torch.device("cpu"),
        max_rows={head.shape: DECODE_BOUNDS[-1]} if head is not None else None,
        counts=quantized_counts(model),
    )
    for run in range(args.runs):
        t0 = time.perf_counter()
        select_quantized_kernels(model, act_dtype=dtype, mode="measure")
        record = load_cached(cache_path(key), key, dtype)
        assert record is not None, "the selection was not cached"
        print(f"run {run + 1}: measured in {time.perf_counter() - t0:.1f} s")
        for c in record.checks:
            print(f"  step check, {c['rows']} rows:")
            for k, (plan, seconds) in enumerate(c["plans"]):
                mark = " *" if k == c["chosen"] else ""
                names = " ".join(f"{o}x{i}:{n}" for o, i, n in plan)
                print(f"    {seconds * 1e3:6.2f} ms  {names}{mark}")


if __name__ == "__main__":
    main()
