"""The numerics Gemma 2 / 3 add to the shared decoder: GeGLU, soft caps, the embedding scale.

Each does what transformers' Gemma modules do, op for op, so float32 results agree bit for
bit; the decoder (``decoder_layer.py``) and the model (``llama.py``) take them where
``ModelArchConfig`` asks.
"""

from __future__ import annotations

import struct

import torch
import torch.nn.functional as F


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = gelu_tanh(gate) * up`` (GeGLU, HF's ``gelu_pytorch_tanh``); returns ``out``.

    NOTE: the ops of transformers' ``act_fn(gate_proj(x)) * up_proj(x)``.
    """
    return torch.mul(F.gelu(gate, approximate="tanh"), up, out=out)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` in ``x``'s dtype (a new tensor), in transformers' order."""
    return torch.tanh(x / cap) * cap


def round_to_dtype(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to float32, then to ``dtype`` (float16 or bfloat16: nearest, ties to
    even), as a Python float: what ``torch.tensor(value).to(dtype)`` holds.

    NOTE: plain Python: under the memory plan's fake tensor mode a tensor has no value to
    read back. Gemma scales its embeddings by ``sqrt(hidden_size)`` rounded so.
    """
    if dtype == torch.float16:
        return struct.unpack("<e", struct.pack("<e", value))[0]
    bits = struct.unpack("<I", struct.pack("<f", value))[0]  # float32 first
    if dtype == torch.bfloat16:
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]
