"""The AMX linear kernel of an older source against the built one, alternating, cold weights.

    git show REV:kvserve/runtime/native/kvserve_amx_linear.cpp > /tmp/old_amx.cpp
    PYTHONPATH=. .venv/bin/python bench/probes/amx_ab.py /tmp/old_amx.cpp [--threads 2]

The old source is built as a library of its own (its ops renamed into ``amx_ab_old``), then
both kernels run the embedded model's projection shapes at several M, each call on another
copy of the weight (~128 MB of copies, as the kernel selection times), three alternating
passes, best pass in us per call.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from kvserve.runtime import native
from kvserve.runtime.amx_linear import amx_available, pack_weight

SHAPES = [(960, 576), (3072, 576), (576, 1536)]  # qkv, gate/up, down
ROWS = (8, 32, 64, 104, 128, 256, 512)


def build_old(source: Path, name: str = "amx_ab_old") -> object:
    """``source`` as the op library ``name`` (its ops renamed out of ``kvserve``); returns its
    ``amx_linear``. Each source needs its own ``name``."""
    text = source.read_text()
    text = text.replace("namespace kvserve {", f"namespace {name}_ns {{", 1)
    text = text.replace("TORCH_LIBRARY_FRAGMENT(kvserve, m)", f"TORCH_LIBRARY({name}, m)")
    text = text.replace(
        "TORCH_LIBRARY_IMPL(kvserve, CPU, m)", f"TORCH_LIBRARY_IMPL({name}, CPU, m)"
    )
    text = text.replace("}  // namespace kvserve", f"}}  // namespace {name}_ns")
    work = Path(tempfile.mkdtemp(prefix=f"{name}_"))
    (work / "old.cpp").write_text(text)
    native.build_extension(name, [work / "old.cpp"], work, f"the AMX kernel of {source}")
    return getattr(torch.ops, name).amx_linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old_source", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not amx_available():
        raise SystemExit(f"no AMX-BF16 here: {native.reason() or 'the CPU lacks it'}")
    torch.set_num_threads(args.threads)
    ops = {"old": build_old(args.old_source), "new": torch.ops.kvserve.amx_linear}
    for n, k in SHAPES:
        copies = max(2, int(128 * 2**20 / (n * k * 2)))
        packed = [pack_weight(torch.randn(n, k).to(torch.bfloat16)) for _ in range(copies)]
        for m in ROWS:
            x = torch.randn(m, k).to(torch.bfloat16)  # [M, K]
            out = torch.empty(m, n, dtype=torch.bfloat16)  # [M, N]
            best = {name: float("inf") for name in ops}
            for _ in range(3):
                for name, op in ops.items():
                    for p in packed:
                        op(out, x, p)
                    t = time.perf_counter()
                    for p in packed:
                        op(out, x, p)
                    best[name] = min(best[name], (time.perf_counter() - t) / copies * 1e6)
            print(f"{n}x{k} M={m}: old {best['old']:.0f} new {best['new']:.0f} us", flush=True)


if __name__ == "__main__":
    main()
