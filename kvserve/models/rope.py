"""Rotary position embeddings (RoPE) of the Llama family: inverse frequencies and cos / sin.

``compute_inv_freq`` supports no scaling, 'linear' and 'llama3' scaling; ``rope_cos_sin``
computes the cos and sign-folded sin of a step's positions, which every layer applies with
``LayerOps.rope_``.
"""

from __future__ import annotations

import math

import torch

from kvserve.runtime.workspace import Workspace


def compute_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict | None
) -> torch.Tensor:  # [head_dim // 2] float32
    """RoPE inverse frequencies; supports no scaling, 'linear' and 'llama3' scaling."""
    inv_freq = 1.0 / (
        rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        factor = float(rope_scaling["factor"])
        low_freq_factor = float(rope_scaling["low_freq_factor"])
        high_freq_factor = float(rope_scaling["high_freq_factor"])
        old_context_len = float(rope_scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"unsupported rope_scaling type {rope_type!r}; supported: default, linear, llama3"
    )


def rope_cos_sin(
    inv_freq: torch.Tensor,
    positions: torch.Tensor,
    dtype: torch.dtype,
    workspace: Workspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin for ``positions``, computed once per step for all layers.

    Returns ``cos`` and ``sin`` of shape ``[T, 1, head_dim]`` where ``sin``'s first half is
    negated, so that ``rotate_half(x) * sin_hf == swap_halves(x) * sin``. With a
    ``workspace`` both live in its buffers.
    """
    ws = workspace if workspace is not None else Workspace()
    num_tokens, half = positions.shape[0], inv_freq.shape[0]
    device = positions.device
    freqs = ws.take("rope_freqs", (num_tokens, half), torch.float32, device)  # [T, d/2]
    torch.mul(positions[:, None], inv_freq[None, :], out=freqs)
    cos = ws.take("rope_cos", (num_tokens, 1, 2 * half), dtype, device)  # [T, 1, d]
    sin = ws.take("rope_sin", (num_tokens, 1, 2 * half), dtype, device)  # [T, 1, d]
    torch.cos(freqs, out=cos[:, 0, :half])
    cos[:, 0, half:].copy_(cos[:, 0, :half])
    torch.sin(freqs, out=sin[:, 0, half:])
    torch.neg(sin[:, 0, half:], out=sin[:, 0, :half])
    return cos, sin
