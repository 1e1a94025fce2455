"""Rotary position embeddings (RoPE): inverse frequencies, their scaling variants, cos / sin.

``compute_rope`` gives the inverse frequencies and the attention scaling of a config's
``rope_scaling``: none, 'linear', 'dynamic' (NTK), 'yarn', 'llama3' and 'longrope' (Phi-3's,
once called 'su'), and 'freq_factors': a divisor per frequency as a GGUF stores Llama 3.x's
scaling (llama.cpp's ``rope_freqs`` tensor, which its converter computes from the llama3
parameters; llama.cpp divides each frequency by it). ``rope_cos_sin`` computes the cos and
sign-folded sin of a step's positions (scaled), which every layer applies with ``LayerOps.rope_``.

The formulas are transformers' (``modeling_rope_utils``), bit for bit where they are static.
Two variants depend on the sequence length in transformers; a paged KV cache keeps keys
rotated once, so here, as in vLLM, they are fixed at start-up:

- 'dynamic': the NTK base of the longest context, ``factor x max_position_embeddings``
  (vLLM's ``DynamicNTKScalingRotaryEmbedding``; transformers' value at that length).
- 'longrope': the long factors for every position when the served ``max_model_len``
  exceeds ``original_max_position_embeddings``, the short ones otherwise (vLLM's
  ``Phi3LongRoPEScaledRotaryEmbedding``; transformers switches per forward at that length).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from kvserve.runtime.workspace import Workspace

# The keys each scaled type needs (beyond rope_type); 'default' needs none.
_REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "freq_factors": ("freq_factors",),
}
ROPE_TYPES = tuple(_REQUIRED_KEYS)
# Older names transformers still reads (Phi-3's first configs said "su").
_ALIASES = {"su": "longrope"}


def rope_type(rope_scaling: Mapping[str, Any] | None) -> str:
    """The (canonical) RoPE type a ``rope_scaling`` dict asks for; 'default' for none."""
    if not rope_scaling:
        return "default"
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    return _ALIASES.get(kind, kind)


def check_rope_scaling(rope_scaling: Mapping[str, Any] | None, head_dim: int) -> None:
    """Raise ValueError naming an unsupported RoPE type, a missing key or factors of the
    wrong length (longrope needs ``head_dim / 2`` of each)."""
    kind = rope_type(rope_scaling)
    if kind not in _REQUIRED_KEYS:
        raise ValueError(
            f"unsupported rope_scaling type {kind!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    params = rope_scaling or {}
    missing = [k for k in _REQUIRED_KEYS[kind] if params.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} lacks {', '.join(map(repr, missing))}")
    if kind in ("longrope", "freq_factors"):
        for key in ("short_factor", "long_factor") if kind == "longrope" else ("freq_factors",):
            factors = params[key]
            if not isinstance(factors, list) or len(factors) != head_dim // 2:
                raise ValueError(
                    f"rope_scaling {key!r} must list head_dim / 2 = {head_dim // 2} numbers"
                )


def compute_rope(
    head_dim: int,
    rope_theta: float,
    rope_scaling: Mapping[str, Any] | None,
    *,
    max_position_embeddings: int | None = None,
    max_model_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies ``[head_dim // 2]`` (float32) and the factor cos and sin are
    multiplied by (yarn, longrope; 1.0 otherwise).

    ``max_position_embeddings``: the model's context length ('dynamic' and 'longrope' need
    it); ``max_model_len``: the context length served (longrope's long / short choice;
    default: the model's). Raises ValueError for an unsupported type or a missing key.
    """
    check_rope_scaling(rope_scaling, head_dim)
    kind = rope_type(rope_scaling)
    base_inv = 1.0 / (
        rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if kind == "default":
        return base_inv, 1.0
    assert rope_scaling is not None
    if kind == "linear":
        return base_inv / float(rope_scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(base_inv, rope_scaling), 1.0
    if kind == "freq_factors":
        return base_inv / torch.tensor(rope_scaling["freq_factors"], dtype=torch.float32), 1.0
    if kind == "yarn":
        return _yarn(head_dim, rope_theta, rope_scaling)
    if max_position_embeddings is None:
        raise ValueError(f"rope_scaling of type {kind!r} needs the model's context length")
    if kind == "dynamic":
        factor = float(rope_scaling["factor"])
        # NOTE: transformers' base at seq_len = factor x max_position_embeddings, fixed.
        longest = factor * max_position_embeddings
        ntk = (factor * longest / max_position_embeddings) - (factor - 1)
        base = rope_theta * ntk ** (head_dim / (head_dim - 2))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponents), 1.0
    return _longrope(head_dim, rope_theta, rope_scaling, max_position_embeddings, max_model_len)


def compute_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: Mapping[str, Any] | None
) -> torch.Tensor:  # [head_dim // 2] float32
    """RoPE inverse frequencies of the static types (``compute_rope`` without the scaling)."""
    return compute_rope(head_dim, rope_theta, rope_scaling)[0]


def _llama3(inv_freq: torch.Tensor, rope_scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1's scaling: low frequencies divided by ``factor``, high ones kept, a smooth
    blend between."""
    factor = float(rope_scaling["factor"])
    low_freq_factor = float(rope_scaling["low_freq_factor"])
    high_freq_factor = float(rope_scaling["high_freq_factor"])
    old_context_len = float(rope_scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    head_dim: int, rope_theta: float, rope_scaling: Mapping[str, Any]
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between
    (over the dimensions ``beta_fast`` / ``beta_slow`` rotations fix), and an attention
    factor on cos / sin."""
    factor = float(rope_scaling["factor"])
    original = float(rope_scaling["original_max_position_embeddings"])
    attention = rope_scaling.get("attention_factor")
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if attention is None:
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (
            2 * math.log(rope_theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # NOTE: transformers' guard against a zero-width ramp
    dims = torch.arange(head_dim // 2, dtype=torch.float32)
    ramp = torch.clamp((dims - low) / (high - low), 0, 1)
    pos_freqs = rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention)


def _longrope(
    head_dim: int,
    rope_theta: float,
    rope_scaling: Mapping[str, Any],
    max_position_embeddings: int,
    max_model_len: int | None,
) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-frequency factors, long ones where the served context exceeds
    the pretraining one (module docstring), and an attention factor from the extension."""
    original = int(rope_scaling["original_max_position_embeddings"])
    factor = rope_scaling.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    attention = rope_scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    served = max_position_embeddings if max_model_len is None else max_model_len
    key = "long_factor" if served > original else "short_factor"
    ext = torch.tensor(rope_scaling[key], dtype=torch.float32)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (ext * rope_theta**exponents), float(attention)


def rope_cos_sin(
    inv_freq: torch.Tensor,
    positions: torch.Tensor,
    dtype: torch.dtype,
    workspace: Workspace | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin for ``positions``, computed once per step for all layers.

    Returns ``cos`` and ``sin`` of shape ``[T, 1, head_dim]`` where ``sin``'s first half is
    negated, so that ``rotate_half(x) * sin_hf == swap_halves(x) * sin``; both multiplied
    by ``scale`` (the attention factor of yarn / longrope). With a ``workspace`` both live
    in its buffers.
    """
    ws = workspace if workspace is not None else Workspace()
    num_tokens, half = positions.shape[0], inv_freq.shape[0]
    device = positions.device
    freqs = ws.take("rope_freqs", (num_tokens, half), torch.float32, device)  # [T, d/2]
    torch.mul(positions[:, None], inv_freq[None, :], out=freqs)
    cos = ws.take("rope_cos", (num_tokens, 1, 2 * half), dtype, device)  # [T, 1, d]
    sin = ws.take("rope_sin", (num_tokens, 1, 2 * half), dtype, device)  # [T, 1, d]
    if scale == 1.0:
        torch.cos(freqs, out=cos[:, 0, :half])
        torch.sin(freqs, out=sin[:, 0, half:])
    else:
        # NOTE: scaled in float32, then rounded once to ``dtype``, as transformers does.
        cos[:, 0, :half].copy_(freqs.cos().mul_(scale))
        sin[:, 0, half:].copy_(freqs.sin().mul_(scale))
    cos[:, 0, half:].copy_(cos[:, 0, :half])
    torch.neg(sin[:, 0, half:], out=sin[:, 0, :half])
    return cos, sin
