"""What int8 weights x int8 activations would cost in accuracy, simulated at every row count:
``kvserve bench accuracy`` with every projection of the bf16 model replaced by a float
simulation of one rounding scheme (the fp32 reference runs as it is).

    PYTHONPATH=. .venv/bin/python bench/probes/int8_accuracy_sim.py MODE [accuracy flags]

MODE: ``none`` (no simulation: the engine's own bf16), ``token`` (a weight scale per output
column, an activation scale per row: W8A8 as vLLM / SmoothQuant-free schemes run it),
``wonly`` (per-column int8 weights, activations exact), ``aonly`` (per-row int8 activations,
weights exact), ``blk64`` (per-column weights, activations per block of 64 inputs) and
``both64`` (weights and activations per block of 64: what ``kvserve::amx_int8_linear``
computes). Used for session 28's choice of blocks of 64 (docs/KERNELS_HISTORY.md), e.g.
``int8_accuracy_sim.py both64 --settings fp32,bf16 --num-prompts 16 --num-recall 10
--threads 2``.
"""

from __future__ import annotations

import sys

import torch

from kvserve.bench import accuracy
from kvserve.runtime import linear as linear_mod

MODES = ("none", "token", "wonly", "aonly", "blk64", "both64")


def _round(t: torch.Tensor, block: int | None) -> torch.Tensor:
    """``t`` [rows, K] rounded to int8 per row (``block`` None) or per block of inputs."""
    rows, k = t.shape
    b = k if block is None else block
    blocks = t.view(rows, k // b, b)
    scale = blocks.abs().amax(2, keepdim=True).clamp_min(1e-30) / 127
    return ((blocks / scale).round().clamp(-127, 127) * scale).view(rows, k)


def simulate(mode: str) -> None:
    """Replace ``Linear.__call__`` for bf16 activations by the float simulation of ``mode``."""
    original = linear_mod.Linear.__call__
    weights: dict[int, torch.Tensor] = {}
    w_block = {"token": None, "wonly": None, "blk64": None, "both64": 64}.get(mode, 0)
    a_block = {"token": None, "aonly": None, "blk64": 64, "both64": 64}.get(mode, 0)

    def call(self, x, out=None, *, out_is_hint=False, out_rows_free=False):  # noqa: ANN001, ANN202
        if x.dtype != torch.bfloat16:
            return original(self, x, out, out_is_hint=out_is_hint, out_rows_free=out_rows_free)
        if id(self) not in weights:
            src = self.source
            if not isinstance(src, torch.Tensor):
                w = src.dequantize(torch.float32)
            else:
                w = (self.rebuild_source() if src.dim() != 2 else src).float()
            weights[id(self)] = w if w_block == 0 else _round(w, w_block)
        xf = x.float()
        xq = xf if a_block == 0 else _round(xf, a_block)
        y = xq @ weights[id(self)].t()
        if self.bias is not None:
            y = y + self.bias.float()
        y = y.to(x.dtype)
        return y if out is None else out.copy_(y)

    linear_mod.Linear.__call__ = call  # type: ignore[method-assign]


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in MODES:
        raise SystemExit(f"usage: int8_accuracy_sim.py {{{','.join(MODES)}}} [accuracy flags]")
    if sys.argv[1] != "none":
        simulate(sys.argv[1])
    return accuracy.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
