"""Resident memory after start-up (issue 16's measure): the engine on the embedded model with a
64-block KV pool, after one short request and ``malloc_trim(0)``; or ``torch`` alone.

    PYTHONPATH=. .venv/bin/python bench/probes/rss_after_startup.py {auto|none|q8_0|torch}

The peer's figure: ``llama-server -m <embedded gguf> -t 2 -c 512 --parallel 1``, one
``/completion`` request, then ``VmRSS`` of its process (README, "Quantized weights").
"""

from __future__ import annotations

import ctypes
import sys


def rss_mib() -> float:
    """This process's VmRSS in MiB."""
    line = next(ln for ln in open("/proc/self/status") if ln.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "auto"
    if what == "torch":
        import torch  # noqa: F401

        print(f"import torch: VmRSS {rss_mib():.1f} MiB")
        return
    from kvserve import LLM, SamplingParams

    llm = LLM(quantization=what, num_kv_blocks=64, num_threads=2)
    llm.generate(["Hi"], SamplingParams(max_tokens=8), use_tqdm=False)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    kv = llm.engine.memory_report.kv_cache_bytes / 2**20
    print(
        f"quantization={what}: VmRSS {rss_mib():.1f} MiB after start-up and one request "
        f"(KV pool {kv:.1f} MiB)"
    )


if __name__ == "__main__":
    main()
