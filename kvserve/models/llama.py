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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import ModelArchConfig
from kvserve.runtime import native
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


class Workspace:
    """Reusable activation buffers for the forward pass, one per role, grown on demand.

    A buffer is reallocated only when a step needs more elements than it holds (or another
    dtype/device), so after the largest step has run once, steps allocate nothing here.
    NOTE: every layer reuses the same buffers: a view handed out is valid only until the next
    ``take`` of that role. Tensors that leave the model (its output) never live here.
    Repeated ``take`` calls with the same shape return the same view object (no tensor ops):
    callers must not change its metadata in place (``resize_``, ``t_``, ...).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        # Last view handed out per role: (shape, dtype, device, view).
        self._views: dict[str, tuple[tuple[int, ...], torch.dtype, torch.device, torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def take(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A contiguous ``shape`` view of role ``name``'s buffer (contents undefined)."""
        hit = self._views.get(name)
        if hit is not None and hit[0] == shape and hit[1] == dtype and hit[2] == device:
            return hit[3]
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buf
        view = buf[:numel].view(shape)
        self._views[name] = (tuple(shape), dtype, device, view)
        return view

    def constant(self, value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 0-dim tensor holding ``value``, made once.

        NOTE: an in-place op with a Python number wraps it in a fresh 0-dim tensor on every
        call; a cached one avoids that allocation.
        """
        key = f"const:{value!r}"
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != dtype or buf.device != device:
            buf = torch.tensor(value, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf

    def like(self, name: str, shape: tuple[int, ...], ref: torch.Tensor) -> torch.Tensor:
        """``take`` with ``ref``'s dtype and device."""
        return self.take(name, shape, ref.dtype, ref.device)


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


def apply_rope_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scratch: torch.Tensor
) -> torch.Tensor:
    """Rotate-half RoPE (HF layout) on ``x`` [T, n_heads, d] in place; returns ``x``.

    ``scratch`` is a contiguous [T, n_heads, d] buffer (overwritten).
    """
    return _rope_(RopeViews.of(x, scratch), cos, sin)


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


def _rope_(r: RopeViews, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope_`` on pre-sliced views; returns ``r.x``."""
    r.scratch_lo.copy_(r.x_hi)
    r.scratch_hi.copy_(r.x_lo)  # swap_halves(x)
    return r.x.mul_(cos).addcmul_(r.scratch, sin)


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


def linear_into(
    x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2-D ``x`` written into ``out``; takes ``weight.t()``."""
    if bias is None:
        return torch.mm(x, weight_t, out=out)
    return torch.addmm(bias, x, weight_t, out=out)


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _linear_param(
    out_features: int, in_features: int, *, dtype: torch.dtype, device: torch.device
) -> nn.Parameter:
    """A linear weight ``[out, in]`` (HF layout) stored transposed: ``.t()`` is contiguous.

    NOTE: on CPU (MKL sgemm, fp32, the embedded model's shapes, M = 1..64 rows) ``x @ w.t()``
    with a contiguous ``[in, out]`` right operand ran 15-25% faster than with a contiguous
    ``[out, in]`` one when the weights are re-read step after step (as in decoding), and the
    same when they come cold from DRAM; a whole decode step was 5-7% faster on one thread.
    cuBLAS takes either layout. ``Module.to`` keeps the strides (``preserve_format``), so the
    layout survives dtype/device moves.
    """
    storage = torch.empty(in_features, out_features, dtype=dtype, device=device)
    return nn.Parameter(storage.t(), requires_grad=False)  # [out, in] view, strides (1, out)


@dataclass(slots=True)
class StepViews:
    """Workspace views that every layer of one step uses (all layers share their shapes).

    NOTE: made once per forward: slicing them in each layer cost ~15 tensor ops per layer,
    0.5 ms of a 3.1 ms forward of the embedded model's 30 layers with tiny matmuls (B=1, one
    thread; a real B=1 decode step is ~40 ms on two). Every layer overwrites the buffers.
    """

    norm: torch.Tensor  # [T, hidden]: normed input, then the o/down projections
    qkv: torch.Tensor  # [T, (H + 2 kvh) d]
    rope: RopeViews  # over qk = qkv[:, :(H + kvh) d] as [T, H + kvh, d]
    q: torch.Tensor  # [T, H, d]
    k: torch.Tensor  # [T, kvh, d]
    v: torch.Tensor  # [T, kvh, d]
    gate_up: torch.Tensor  # [T, 2 I]
    gate: torch.Tensor  # [T, I]
    up: torch.Tensor  # [T, I]


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
        self.qkv_weight = _linear_param(self.q_size + 2 * self.kv_size, hidden, **kw)
        self.register_parameter("qkv_bias", None)
        self.o_weight = _linear_param(hidden, self.q_size, **kw)
        self.register_parameter("o_bias", None)
        self.post_attention_layernorm = _param(hidden, **kw)
        self.gate_up_weight = _linear_param(2 * arch.intermediate_size, hidden, **kw)
        self.register_parameter("gate_up_bias", None)
        self.down_weight = _linear_param(hidden, arch.intermediate_size, **kw)
        self.register_parameter("down_bias", None)
        # Use the native CPU kernels for norms, RoPE and SiLU (set by the model).
        self.native_ops = False
        self._weights_t: tuple[torch.Tensor, ...] | None = None

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # NOTE: .to()/.half()/... may swap the parameters' storage: drop the cached views.
        self._weights_t = None
        return super()._apply(fn, recurse)

    def weights_t(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The [in, out] views ``w.t()`` of the qkv, o, gate/up and down weights.

        NOTE: made once and kept: ``t()`` is a dispatched op (~7-14 us with its
        ``as_strided``), four per layer per step, ~1-2 ms of a decode step otherwise.
        Parameters are only ever written in place (``load_weights``) or moved by
        ``Module._apply``, which drops this cache.
        """
        if self._weights_t is None:
            self._weights_t = (
                self.qkv_weight.t(),
                self.o_weight.t(),
                self.gate_up_weight.t(),
                self.down_weight.t(),
            )
        return self._weights_t  # type: ignore[return-value]

    def step_views(self, ws: Workspace, hidden: torch.Tensor) -> StepViews:
        """This step's ``StepViews`` for ``hidden`` [T, hidden], in ``ws``'s buffers."""
        num_tokens, hidden_size = hidden.shape
        num_qk_heads = self.num_heads + self.num_kv_heads
        qk_size = self.q_size + self.kv_size
        inter = self.intermediate_size
        qkv = ws.like("qkv", (num_tokens, qk_size + self.kv_size), hidden)
        qk = qkv[:, :qk_size].view(num_tokens, num_qk_heads, self.head_dim)
        scratch = ws.like("rope_scratch", (num_tokens, num_qk_heads, self.head_dim), hidden)
        gate_up = ws.like("gate_up", (num_tokens, 2 * inter), hidden)
        return StepViews(
            norm=ws.like("norm", (num_tokens, hidden_size), hidden),
            qkv=qkv,
            rope=RopeViews.of(qk, scratch),
            q=qk[:, : self.num_heads],
            k=qk[:, self.num_heads :],
            v=qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim),
            gate_up=gate_up,
            gate=gate_up[:, :inter],
            up=gate_up[:, inter:],
        )

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden] residual stream (updated in place)
        cos: torch.Tensor,  # [T, 1, d]
        sin: torch.Tensor,  # [T, 1, d]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kvh, d]
        meta: AttentionMetadata,
        workspace: Workspace | None = None,
        views: StepViews | None = None,
    ) -> torch.Tensor:
        """Add this layer's attention and MLP outputs to ``hidden`` in place; returns it.

        ``views`` (from ``step_views`` on ``workspace``) may be shared by all layers of a step.
        """
        ws = workspace if workspace is not None else Workspace()
        sv = views if views is not None else self.step_views(ws, hidden)
        if self.native_ops and hidden.device.type == "cpu":
            return self._forward_native(hidden, cos, sin, kv_cache, meta, ws, sv)
        qkv_t, o_t, gate_up_t, down_t = self.weights_t()
        x = sv.norm  # [T, hidden]
        rms_norm_into(hidden, self.input_layernorm, self.eps, x, ws)
        linear_into(x, qkv_t, self.qkv_bias, sv.qkv)
        _rope_(sv.rope, cos, sin)  # q and k, in place
        attn = self.attn_backend.forward(sv.q, sv.k, sv.v, kv_cache, meta)  # [T, H, d]
        attn = attn.reshape(hidden.shape[0], self.q_size)  # [T, H d]
        # NOTE: project into the spent norm buffer, then add: bitwise equal to F.linear + add.
        # addmm_ into the residual rounds differently; on the embedded model it drifted to 3e-3
        # max |logit diff| vs transformers (9e-4 this way).
        hidden.add_(linear_into(attn, o_t, self.o_bias, x))
        rms_norm_into(hidden, self.post_attention_layernorm, self.eps, x, ws)
        linear_into(x, gate_up_t, self.gate_up_bias, sv.gate_up)
        act = F.silu(sv.gate, inplace=True).mul_(sv.up)  # [T, I]
        hidden.add_(linear_into(act, down_t, self.down_bias, x))
        return hidden

    def _forward_native(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, d]
        sin: torch.Tensor,  # [T, 1, d]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        ws: Workspace,
        sv: StepViews,
    ) -> torch.Tensor:
        """``forward`` with the native CPU kernels: 12 dispatched ops a layer instead of ~34.

        Same math and rounding points as the torch path; only summation order differs.
        """
        ops = torch.ops.kvserve
        qkv_t, o_t, gate_up_t, down_t = self.weights_t()
        x = sv.norm  # [T, hidden]
        ops.add_rms_norm(hidden, None, self.input_layernorm, self.eps, x)
        linear_into(x, qkv_t, self.qkv_bias, sv.qkv)
        ops.rope_(sv.rope.x, cos, sin)  # q and k, in place
        attn = self.attn_backend.forward(sv.q, sv.k, sv.v, kv_cache, meta)  # [T, H, d]
        linear_into(attn.reshape(hidden.shape[0], self.q_size), o_t, self.o_bias, x)
        # hidden += o-projection, then x = norm(hidden): one pass.
        ops.add_rms_norm(hidden, x, self.post_attention_layernorm, self.eps, x)
        linear_into(x, gate_up_t, self.gate_up_bias, sv.gate_up)
        ops.silu_mul(sv.gate, sv.gate_up)  # [T, I] over the gate half, in place
        hidden.add_(linear_into(sv.gate, down_t, self.down_bias, x))
        return hidden


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache (see module docstring)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attn_backend: AttentionBackend | str = "auto",
        native_ops: bool | None = None,
    ) -> None:
        """``attn_backend``: a backend or its name (see ``get_attention_backend``; 'auto'
        takes the native CPU kernels where they load). ``native_ops``: run norms, RoPE and
        SiLU with the native CPU kernels (on CPU tensors); None = where they load.
        """
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
        self.set_native_ops(native.available() if native_ops is None else native_ops)

    @property
    def native_ops(self) -> bool:
        """Whether the layers run norms, RoPE and SiLU with the native CPU kernels."""
        return self._native_ops

    def set_native_ops(self, enabled: bool) -> None:
        """Switch the native CPU kernels for norms, RoPE and SiLU on or off.

        Raises ValueError when turning them on and they cannot be loaded.
        """
        if enabled and not native.available():
            raise ValueError(f"native CPU kernels unavailable: {native.reason()}")
        self._native_ops = enabled
        for layer in self.layers:
            layer.native_ops = enabled

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
        workspace: Workspace | None = None,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        """Run all layers over a flat batch, writing/reading K/V through ``meta``.

        ``workspace`` holds the activations between steps (pass the same one every step to
        allocate nothing once warm); None uses a fresh one for this call. The returned tensor
        is always newly allocated, never a workspace buffer.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} layer caches, got {len(kv_caches)}")
        ws = workspace if workspace is not None else Workspace()
        emb = self.embed_tokens
        hidden = ws.like("hidden", (input_ids.shape[0], emb.shape[1]), emb)  # [T, hidden]
        torch.index_select(emb, 0, input_ids, out=hidden)
        cos, sin = rope_cos_sin(self._inv_freq_on(positions.device), positions, hidden.dtype, ws)
        views = self.layers[0].step_views(ws, hidden)  # every layer has the same shapes
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            layer(hidden, cos, sin, kv_cache, meta, ws, views)
        out = torch.empty_like(hidden)  # [T, hidden]
        if self._native_ops and hidden.device.type == "cpu":
            torch.ops.kvserve.add_rms_norm(hidden, None, self.norm, self.arch.rms_norm_eps, out)
            return out
        return rms_norm_into(hidden, self.norm, self.arch.rms_norm_eps, out, ws)

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
