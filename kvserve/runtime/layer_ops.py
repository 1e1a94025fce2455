"""The elementwise kernels of a decoder layer behind one object, chosen once at load.

``LayerOps`` names what a pre-norm Llama block needs besides its projections (see
``kvserve.runtime.linear``) and attention: (add +) RMSNorm, rotate-half RoPE in place, and
SiLU(gate) * up. ``TorchLayerOps`` runs them as torch ops (any device, any dtype);
``NativeLayerOps`` runs the fused C++ kernels of ``kvserve.runtime.native`` (CPU tensors):
12 dispatched ops a layer instead of ~34. Both have the same math and rounding points; only
the summation order differs. ``layer_ops(native=...)`` picks one.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.runtime import native
from kvserve.runtime.workspace import Workspace


@dataclass(slots=True)
class RopeViews:
    """``x`` [T, n, d], a same-shape ``scratch``, and the halves (last dim) of both."""

    x: torch.Tensor
    x_lo: torch.Tensor  # x[..., :d/2]
    x_hi: torch.Tensor  # x[..., d/2:]
    scratch: torch.Tensor
    scratch_lo: torch.Tensor
    scratch_hi: torch.Tensor

    @classmethod
    def of(cls, x: torch.Tensor, scratch: torch.Tensor) -> RopeViews:
        """Slice the halves of ``x`` and ``scratch``."""
        half = x.shape[-1] // 2
        return cls(
            x, x[..., :half], x[..., half:], scratch, scratch[..., :half], scratch[..., half:]
        )


def rope_views_(r: RopeViews, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF layout) on pre-sliced views, in place; returns ``r.x``."""
    r.scratch_lo.copy_(r.x_hi)
    r.scratch_hi.copy_(r.x_lo)  # swap_halves(x)
    return r.x.mul_(cos).addcmul_(r.scratch, sin)


def apply_rope_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scratch: torch.Tensor
) -> torch.Tensor:
    """Rotate-half RoPE (HF layout) on ``x`` [T, n_heads, d] in place; returns ``x``.

    ``scratch`` is a contiguous [T, n_heads, d] buffer (overwritten).
    """
    return rope_views_(RopeViews.of(x, scratch), cos, sin)


def rms_norm_into(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor, ws: Workspace
) -> torch.Tensor:
    """RMSNorm of ``x`` [T, h] into ``out`` [T, h] (the ops of ``F.rms_norm``, no temporaries)."""
    if x.dtype not in (torch.float32, torch.float64):
        # NOTE: F.rms_norm computes half types in float32; keep its numerics there.
        return out.copy_(F.rms_norm(x, (x.shape[-1],), weight, eps))
    var = ws.like("rms_var", (x.shape[0], 1), x)  # [T, 1]
    torch.mul(x, x, out=out)
    # NOTE: sum then divide is what torch.mean does on CPU, minus its scalar temporaries.
    torch.sum(out, dim=-1, keepdim=True, out=var)
    var.div_(ws.constant(float(x.shape[-1]), x.dtype, x.device))
    var.add_(ws.constant(eps, x.dtype, x.device)).rsqrt_()
    return torch.mul(x, var, out=out).mul_(weight)


class LayerOps(abc.ABC):
    """The non-GEMM, non-attention kernels of one decoder layer."""

    name: str

    @abc.abstractmethod
    def add_rms_norm(
        self,
        hidden: torch.Tensor,  # [T, h] residual stream
        residual: torch.Tensor | None,  # [T, h] added to ``hidden`` in place first, or None
        weight: torch.Tensor,  # [h]
        eps: float,
        out: torch.Tensor,  # [T, h] (may be ``residual``)
        ws: Workspace,
    ) -> torch.Tensor:
        """``hidden += residual`` (if given), then ``out = RMSNorm(hidden)``; returns ``out``."""

    @abc.abstractmethod
    def rope_(self, r: RopeViews, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on ``r.x`` [T, n, d] in place (``cos``/``sin`` [T, 1, d]); returns ``r.x``."""

    @abc.abstractmethod
    def silu_mul(
        self, gate: torch.Tensor, up: torch.Tensor, gate_up: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """``out = SiLU(gate) * up`` (``gate``/``up``: the halves of ``gate_up`` [T, 2I];
        ``out`` [T, I] contiguous; ``gate`` may be overwritten); returns ``out``."""


class TorchLayerOps(LayerOps):
    """Torch ops (any device, any dtype)."""

    name = "torch"

    def add_rms_norm(self, hidden, residual, weight, eps, out, ws):  # type: ignore[no-untyped-def]
        if residual is not None:
            hidden.add_(residual)
        return rms_norm_into(hidden, weight, eps, out, ws)

    def rope_(self, r, cos, sin):  # type: ignore[no-untyped-def]
        return rope_views_(r, cos, sin)

    def silu_mul(self, gate, up, gate_up, out):  # type: ignore[no-untyped-def]
        return torch.mul(F.silu(gate, inplace=True), up, out=out)


class NativeLayerOps(LayerOps):
    """The fused C++ kernels (``torch.ops.kvserve``; CPU tensors only)."""

    name = "native"

    def add_rms_norm(self, hidden, residual, weight, eps, out, ws):  # type: ignore[no-untyped-def]
        torch.ops.kvserve.add_rms_norm(hidden, residual, weight, eps, out)
        return out

    def rope_(self, r, cos, sin):  # type: ignore[no-untyped-def]
        torch.ops.kvserve.rope_(r.x, cos, sin)
        return r.x

    def silu_mul(self, gate, up, gate_up, out):  # type: ignore[no-untyped-def]
        torch.ops.kvserve.silu_mul(out, gate_up)
        return out


TORCH_OPS = TorchLayerOps()
NATIVE_OPS = NativeLayerOps()


def layer_ops(*, native_kernels: bool, device: torch.device) -> LayerOps:
    """The ops for a model on ``device``: native where asked for and on CPU, else torch.

    Raises ValueError when the native kernels are asked for and cannot be loaded.
    """
    if native_kernels and not native.available():
        raise ValueError(f"native CPU kernels unavailable: {native.reason()}")
    return NATIVE_OPS if native_kernels and device.type == "cpu" else TORCH_OPS
