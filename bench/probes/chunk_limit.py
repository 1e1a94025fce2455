"""The start-up chunk-attention measurement, run again (``mode="measure"``) and printed.

    PYTHONPATH=. .venv/bin/python bench/probes/chunk_limit.py [--dtype bfloat16 float32]
        [--max-tokens 2048]

For the embedded model's heads: us a layer of the decode kernel vs SDPA (for bf16 also
SDPA in float32) on chunks of 16 .. ``--max-tokens`` rows, and the choice the engine would
take (kvserve/runtime/native/chunk_limit.py; timing stops at the first size the kernel
loses).
"""

from __future__ import annotations

import argparse
import logging

import torch

from kvserve.engine_config import EngineConfig
from kvserve.models.loader import load_arch
from kvserve.runtime.native.chunk_limit import chunk_attention_limit

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("kvserve").setLevel(logging.INFO)
    torch.set_num_threads(args.threads)
    arch = load_arch(EngineConfig().model)
    for name in args.dtype:
        choice = chunk_attention_limit(arch, getattr(torch, name), args.max_tokens, mode="measure")
        print(f"{name}: {choice.summary()}")
