"""``TritonLayerOps``: the ``LayerOps`` of a model on CUDA, one Triton launch per op."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from kvserve.runtime.layer_ops import TORCH_OPS, LayerOps, RopeViews
from kvserve.runtime.triton_ops.rms_norm import add_rms_norm
from kvserve.runtime.triton_ops.rope import rope_
from kvserve.runtime.triton_ops.silu_mul import silu_mul
from kvserve.runtime.workspace import Workspace


class TritonLayerOps(LayerOps):
    """Fused residual-add + RMSNorm, RoPE in place and SiLU x up as Triton kernels (the
    torch path takes 2-6 launches for each; float32 inside, as ``F.rms_norm`` for half
    types)."""

    name = "triton"

    def add_rms_norm(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        out: torch.Tensor,
        ws: Workspace,
    ) -> torch.Tensor:
        if isinstance(hidden, FakeTensor):  # traced by the memory plan: no launch
            return TORCH_OPS.add_rms_norm(hidden, residual, weight, eps, out, ws)
        return add_rms_norm(hidden, residual, weight, eps, out)

    def rope_(self, r: RopeViews, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if isinstance(r.x, FakeTensor):
            return TORCH_OPS.rope_(r, cos, sin)
        return rope_(r.x, cos, sin)

    def silu_mul(
        self, gate: torch.Tensor, up: torch.Tensor, gate_up: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        if (
            isinstance(gate, FakeTensor)
            or gate.data_ptr() != gate_up.data_ptr()
            or up.data_ptr() != gate.data_ptr() + gate.shape[1] * gate.element_size()
            or gate_up.stride(1) != 1
        ):
            # NOTE: the kernel reads the halves of one [T, 2I] buffer; anything else: torch.
            return TORCH_OPS.silu_mul(gate, up, gate_up, out)
        return silu_mul(gate_up, out)


TRITON_OPS = TritonLayerOps()
