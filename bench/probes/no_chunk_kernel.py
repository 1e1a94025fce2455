"""Run a kvserve command with every prefill chunk attending through SDPA in the model's
dtype (the path before the start-up chunk choice, kvserve/runtime/native/chunk_limit.py):
the A side of an A/B.

    PYTHONPATH=. .venv/bin/python bench/probes/no_chunk_kernel.py -m kvserve.cli \\
        bench throughput ...
    PYTHONPATH=. .venv/bin/python bench/probes/no_chunk_kernel.py \\
        bench/probes/serve_trace.py OUT.json serve ...
"""

from __future__ import annotations

import runpy
import sys

import kvserve.runtime.native.chunk_limit as chunk_limit
from kvserve.runtime.native.chunk_limit import ChunkAttention


def _no_limit(*args: object, **kwargs: object) -> ChunkAttention:
    return ChunkAttention()


if __name__ == "__main__":
    # NOTE: the engine and runtime_speed both reach it through configure_backend.
    chunk_limit.chunk_attention_limit = _no_limit  # type: ignore[assignment]
    args = sys.argv[1:]
    if args[:1] == ["-m"]:
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")
