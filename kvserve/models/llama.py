"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

The forward pass works on one flattened (ragged) batch of ``T`` tokens from many sequences:
no padding in the linear layers. Attention goes through an ``AttentionBackend`` that writes
the new K/V through the step's slot mapping and reads the context through block tables.

Weights are loaded from HF-named tensors and fused at load time: q/k/v into one
``[(H + 2 * kvh) * d, hidden]`` matrix and gate/up into one ``[2 * intermediate, hidden]``
matrix, so each layer runs four matmuls.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import ModelArchConfig
from kvserve.runtime.attention import AttentionBackend, AttentionMetadata, get_attention_backend


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
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin for ``positions``, computed once per step for all layers.

    Returns ``cos`` and ``sin`` of shape ``[T, 1, head_dim]`` where ``sin``'s first half is
    negated, so that ``rotate_half(x) * sin_hf == swap_halves(x) * sin``.
    """
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, d/2]
    cos = freqs.cos()
    sin = freqs.sin()
    cos = torch.cat((cos, cos), dim=-1)  # [T, d]
    sin = torch.cat((-sin, sin), dim=-1)  # [T, d]
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF layout) on ``x`` [T, n_heads, d]; returns a new tensor."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # [T, n, d]
    return torch.addcmul(x * cos, swapped, sin)


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    """One pre-norm block: attention (fused qkv) + SwiGLU MLP (fused gate/up)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        attn_backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        hidden, d = arch.hidden_size, arch.head_dim
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = d
        self.intermediate_size = arch.intermediate_size
        self.eps = arch.rms_norm_eps
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.attn_backend = attn_backend
        kw = {"dtype": dtype, "device": device}
        self.input_layernorm = _param(hidden, **kw)
        self.qkv_weight = _param(self.q_size + 2 * self.kv_size, hidden, **kw)
        self.register_parameter("qkv_bias", None)
        self.o_weight = _param(hidden, self.q_size, **kw)
        self.register_parameter("o_bias", None)
        self.post_attention_layernorm = _param(hidden, **kw)
        self.gate_up_weight = _param(2 * arch.intermediate_size, hidden, **kw)
        self.register_parameter("gate_up_bias", None)
        self.down_weight = _param(hidden, arch.intermediate_size, **kw)
        self.register_parameter("down_bias", None)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden] residual stream (updated in place)
        cos: torch.Tensor,  # [T, 1, d]
        sin: torch.Tensor,  # [T, 1, d]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kvh, d]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens, hidden_size = hidden.shape
        x = F.rms_norm(hidden, (hidden_size,), self.input_layernorm, self.eps)
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)  # [T, (H + 2 kvh) d]
        qk_size = self.q_size + self.kv_size
        qk = qkv[:, :qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rope(qk, cos, sin)  # [T, H + kvh, d]
        q = qk[:, : self.num_heads]  # [T, H, d]
        k = qk[:, self.num_heads :]  # [T, kvh, d]
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, kvh, d]
        attn = self.attn_backend.forward(q, k, v, kv_cache, meta)  # [T, H, d]
        hidden = hidden + F.linear(
            attn.reshape(num_tokens, self.q_size), self.o_weight, self.o_bias
        )
        x = F.rms_norm(hidden, (hidden_size,), self.post_attention_layernorm, self.eps)
        gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)  # [T, 2 I]
        act = F.silu(gate_up[:, : self.intermediate_size]) * gate_up[:, self.intermediate_size :]
        return hidden + F.linear(act, self.down_weight, self.down_bias)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache (see module docstring)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attn_backend: AttentionBackend | str = "torch_sdpa",
    ) -> None:
        super().__init__()
        if arch.num_attention_heads % arch.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({arch.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({arch.num_key_value_heads})"
            )
        device = torch.device(device)
        self.arch = arch
        if isinstance(attn_backend, str):
            attn_backend = get_attention_backend(attn_backend)
        self.attn_backend = attn_backend
        kw = {"dtype": dtype, "device": device}
        self.embed_tokens = _param(arch.vocab_size, arch.hidden_size, **kw)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, attn_backend, **kw) for _ in range(arch.num_hidden_layers)
        )
        self.norm = _param(arch.hidden_size, **kw)
        self.lm_head = (
            self.embed_tokens
            if arch.tie_word_embeddings
            else _param(arch.vocab_size, arch.hidden_size, **kw)
        )
        # NOTE: kept out of the parameters/buffers so .to(dtype) never lowers its precision.
        self._inv_freq = compute_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    def set_attention_backend(self, backend: AttentionBackend | str) -> None:
        """Swap the attention backend of every layer."""
        if isinstance(backend, str):
            backend = get_attention_backend(backend)
        self.attn_backend = backend
        for layer in self.layers:
            layer.attn_backend = backend

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        inv = self._inv_freq_by_device.get(device)
        if inv is None:
            inv = self._inv_freq.to(device)
            self._inv_freq_by_device[device] = inv
        return inv

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kvh, d]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        """Run all layers over a flat batch, writing/reading K/V through ``meta``."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} layer caches, got {len(kv_caches)}")
        hidden = F.embedding(input_ids, self.embed_tokens)  # [T, hidden]
        cos, sin = rope_cos_sin(self._inv_freq_on(positions.device), positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        return F.rms_norm(hidden, (hidden.shape[-1],), self.norm, self.arch.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] (float32) for the rows of ``hidden`` [N, hidden] that sample."""
        return F.linear(hidden, self.lm_head).float()

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into the fused parameters.

        Raises ValueError naming a missing, unexpected or mis-shaped tensor.
        """
        sd = dict(state_dict)
        used: set[str] = set()

        def take(name: str, target: torch.Tensor) -> None:
            if name not in sd:
                raise ValueError(f"missing weight {name!r}")
            t = sd[name]
            if tuple(t.shape) != tuple(target.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(t.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(t)
            used.add(name)

        def optional_bias(name: str, size: int) -> nn.Parameter | None:
            if name not in sd:
                return None
            p = _param(size, dtype=self.norm.dtype, device=self.norm.device)
            take(name, p)
            return p

        take("model.embed_tokens.weight", self.embed_tokens)
        take("model.norm.weight", self.norm)
        if self.arch.tie_word_embeddings:
            used.add("lm_head.weight")  # HF state_dicts list the tied tensor too
        else:
            take("lm_head.weight", self.lm_head)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            qs, kvs = layer.q_size, layer.kv_size
            take(p + "input_layernorm.weight", layer.input_layernorm)
            take(p + "post_attention_layernorm.weight", layer.post_attention_layernorm)
            w = layer.qkv_weight
            take(p + "self_attn.q_proj.weight", w[:qs])
            take(p + "self_attn.k_proj.weight", w[qs : qs + kvs])
            take(p + "self_attn.v_proj.weight", w[qs + kvs :])
            if self.arch.attention_bias or p + "self_attn.q_proj.bias" in sd:
                layer.qkv_bias = _param(qs + 2 * kvs, dtype=w.dtype, device=w.device)
                b = layer.qkv_bias
                take(p + "self_attn.q_proj.bias", b[:qs])
                take(p + "self_attn.k_proj.bias", b[qs : qs + kvs])
                take(p + "self_attn.v_proj.bias", b[qs + kvs :])
            take(p + "self_attn.o_proj.weight", layer.o_weight)
            layer.o_bias = optional_bias(p + "self_attn.o_proj.bias", self.arch.hidden_size)
            inter = layer.intermediate_size
            take(p + "mlp.gate_proj.weight", layer.gate_up_weight[:inter])
            take(p + "mlp.up_proj.weight", layer.gate_up_weight[inter:])
            take(p + "mlp.down_proj.weight", layer.down_weight)
            if p + "mlp.gate_proj.bias" in sd:
                layer.gate_up_bias = _param(2 * inter, dtype=w.dtype, device=w.device)
                take(p + "mlp.gate_proj.bias", layer.gate_up_bias[:inter])
                take(p + "mlp.up_proj.bias", layer.gate_up_bias[inter:])
            layer.down_bias = optional_bias(p + "mlp.down_proj.bias", self.arch.hidden_size)
        unexpected = sorted(
            k for k in sd if k not in used and not k.endswith("rotary_emb.inv_freq")
        )
        if unexpected:
            raise ValueError(f"unexpected weights: {unexpected[:5]} ({len(unexpected)} total)")
