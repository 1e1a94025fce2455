"""``silu_mul``'s output bits from this process's build, saved for comparing builds.

    KVSERVE_NATIVE_MARCH=<target> KVSERVE_CACHE_DIR=<dir> PYTHONPATH=. \\
        .venv/bin/python bench/probes/silu_bits.py OUT.pt
    .venv/bin/python bench/probes/silu_bits.py --compare A.pt B.pt

One row of 299008 gate values (a [-100, 100] sweep in steps of 1e-3, N(0, 64) draws, the
clamp's edges, +-0 and +-1e-30) times N(0, 1) up values, in float32 and bfloat16. Builds for
different targets (x86-64: the scalar row without FMA; x86-64-v3: the AVX2 row; native) run
different code for the same op; ``--compare`` counts the elements whose bits differ.
"""

from __future__ import annotations

import sys

import torch

from kvserve.runtime import native


def outputs() -> dict[str, torch.Tensor]:
    """dtype name -> silu_mul's [1, n] output on the fixed inputs."""
    if not native.load():
        raise SystemExit(f"no native kernels: {native.reason()}")
    ops = native.ops()
    gen = torch.Generator().manual_seed(0)
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        edges = torch.tensor([0.0, -0.0, 88.5, -88.5, 87.3, -87.4, 1e-30, -1e-30])
        x = torch.cat([torch.linspace(-100, 100, 200001), torch.randn(100000, generator=gen) * 8])
        x = torch.cat([x, edges])
        n = x.numel() - x.numel() % 1024
        gate_up = torch.stack([x[:n], torch.randn(n, generator=gen)]).to(dt).reshape(1, 2 * n)
        o = torch.empty(1, n, dtype=dt)  # [1, n]
        ops.silu_mul(o, gate_up)
        out[str(dt)] = o
    return out


def main() -> None:
    if sys.argv[1] == "--compare":
        a, b = torch.load(sys.argv[2]), torch.load(sys.argv[3])
        for name, x in a.items():
            bits = torch.int16 if x.dtype == torch.bfloat16 else torch.int32
            differ = x.view(bits) != b[name].view(bits)
            nans = int(x[differ].float().isnan().sum() + b[name][differ].float().isnan().sum())
            print(f"{name}: {int(differ.sum())} of {x.numel()} differ ({nans} NaN among them)")
        return
    torch.save(outputs(), sys.argv[1])


if __name__ == "__main__":
    main()
