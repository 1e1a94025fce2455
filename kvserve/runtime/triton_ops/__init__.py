"""The elementwise kernels of a decoder layer in Triton (``TritonLayerOps``), one kernel to a
file: fused residual-add + RMSNorm (``rms_norm.py``), RoPE in place (``rope.py``) and
SiLU(gate) * up (``silu_mul.py``); ``ops.py`` puts them behind ``LayerOps``.

On CUDA they replace the torch ops' several launches per norm / RoPE / activation with one
each; on CPU tensors they run under ``TRITON_INTERPRET=1`` (the tests). Importing ``ops``
imports triton: check ``kvserve.runtime.attention.triton.unavailable_reason`` first.
"""

from __future__ import annotations

import torch

from kvserve.runtime.attention.triton import unavailable_reason
from kvserve.runtime.layer_ops import LayerOps


def cuda_layer_ops(device: torch.device) -> LayerOps | None:
    """``TritonLayerOps`` for a model on a CUDA ``device`` where triton runs, else None."""
    if device.type != "cuda" or unavailable_reason(device) is not None:
        return None
    from kvserve.runtime.triton_ops.ops import TRITON_OPS

    return TRITON_OPS
