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
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from kvserve.config import ModelArchConfig
from kvserve.models.fused_layers import (
    LINEAR_VERSIONS,
    FusedLayers,
    enabled_by_env,
    run_fused_layers,
)
from kvserve.models.quant import QuantizedWeight
from kvserve.models.quant_linear import embedding_lookup
from kvserve.models.quant_model import attach_quantized
from kvserve.runtime import (
    amx_linear,  # noqa: F401 - registers the AMX linear candidate
    native,
)
from kvserve.runtime.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from kvserve.runtime.autotune.candidates import build_linear
from kvserve.runtime.layer_ops import TORCH_OPS, LayerOps, RopeViews, layer_ops
from kvserve.runtime.linear import Linear, LinearPlan
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


# The projections of a decoder layer: ``<name>_weight`` parameters, ``<name>_proj`` Linears.
PROJECTIONS = ("qkv", "o", "gate_up", "down")


def _released_param(like: torch.Tensor) -> nn.Parameter:
    """A 0-element parameter keeping ``like``'s dtype and device (what ``.to()`` moves)."""
    return nn.Parameter(torch.empty(0, dtype=like.dtype, device=like.device), requires_grad=False)


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
    # NOTE: contiguous, unlike gate: a kernel that needs contiguous rows (oneDNN) would copy.
    act: torch.Tensor  # [T, I] SiLU(gate) * up, the down projection's input
    attn: torch.Tensor  # [T, H, d] attention output (a backend may return its own instead)
    attn_rows: torch.Tensor  # [T, H d] the same storage, the o projection's input


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
        # The kernels: norms/RoPE/SiLU (set by the model) and one Linear per projection,
        # built from the weights on first use after a load or a dtype/device move.
        self.ops: LayerOps = TORCH_OPS
        self.linear_plan: LinearPlan | None = None
        self.qkv_proj: Linear
        self.o_proj: Linear
        self.gate_up_proj: Linear
        self.down_proj: Linear
        self._linears_key: tuple[torch.dtype, torch.device] | None = None
        # A new number for each build of the projections (fused_layers keys on it).
        self.linears_version = 0
        # Quantized weight sources by projection ("qkv", ...), set by attach_quantized.
        self.quantized: dict[str, Any] = {}
        # Projections whose weight parameter was freed (``release_packed_weights``): their
        # Linear's prepacked copy is the only one, and rebuilds the weight when needed.
        self.released: set[str] = set()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        out = super()._apply(fn, recurse)
        # NOTE: .to() with the same dtype and device keeps the storage (and any packed copy).
        if self._linears_key != (self.qkv_weight.dtype, self.qkv_weight.device):
            self._linears_key = None
        return out

    def invalidate_linears(self) -> None:
        """Rebuild the projections on next use (after the weights were written in place)."""
        self._linears_key = None

    def ensure_linears(self) -> None:
        """Build the projections unless they are current."""
        if self._linears_key is None:
            self.build_linears()

    def release_packed_weights(self) -> int:
        """Free the weight parameter of each projection that runs only on its own prepacked
        copy (which can rebuild it): a 0-element parameter of the same dtype and device takes
        its place. Returns the bytes freed. The weights come back (``restore_weights``) before
        the projections are rebuilt or the weights loaded again.
        """
        self.ensure_linears()
        freed = 0
        for proj in PROJECTIONS:
            lin: Linear = getattr(self, f"{proj}_proj")
            if proj in self.quantized or proj in self.released or not lin.can_free_source():
                continue
            weight = getattr(self, f"{proj}_weight")
            freed += weight.numel() * weight.element_size()
            placeholder = _released_param(weight)
            lin.release_source(placeholder)
            setattr(self, f"{proj}_weight", placeholder)
            self.released.add(proj)
        return freed

    def restore_weights(self) -> None:
        """Give back the parameters freed by ``release_packed_weights`` (rebuilt exactly from
        the prepacked copies, in the parameters' current dtype and device)."""
        for proj in sorted(self.released):
            lin: Linear = getattr(self, f"{proj}_proj")
            placeholder = getattr(self, f"{proj}_weight")
            dense = lin.rebuild_source()  # [out, in]
            weight = _linear_param(*dense.shape, dtype=placeholder.dtype, device=placeholder.device)
            with torch.no_grad():
                weight.copy_(dense)
            setattr(self, f"{proj}_weight", weight)
        self.released.clear()

    def build_linears(self) -> list[Linear]:
        """Build the four projections from the weights (per ``linear_plan``); returns them."""
        self.restore_weights()
        w = self.qkv_weight
        kw = {"act_dtype": w.dtype, "device": w.device}
        plan = self.linear_plan

        def make(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
            choice = plan.get(tuple(weight.shape)) if plan is not None else None
            return build_linear(weight, bias, choice=choice, **kw)

        q = self.quantized
        self.qkv_proj = make(q.get("qkv", self.qkv_weight), self.qkv_bias)
        self.o_proj = make(q.get("o", self.o_weight), self.o_bias)
        self.gate_up_proj = make(q.get("gate_up", self.gate_up_weight), self.gate_up_bias)
        self.down_proj = make(q.get("down", self.down_weight), self.down_bias)
        self._linears_key = (w.dtype, w.device)
        self.linears_version = next(LINEAR_VERSIONS)
        return [self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj]

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
        attn_rows = ws.like("attn", (num_tokens, self.q_size), hidden)
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
            act=ws.like("act", (num_tokens, inter), hidden),
            attn=attn_rows.view(num_tokens, self.num_heads, self.head_dim),
            attn_rows=attn_rows,
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
        residual: torch.Tensor | None = None,  # [T, hidden] the previous layer's MLP output
    ) -> torch.Tensor:  # [T, hidden] this layer's MLP output, not yet added to ``hidden``
        """Add ``residual`` (if given) and this layer's attention output to ``hidden`` in
        place; returns this layer's MLP output for the caller to add.

        NOTE: why the MLP output is handed on instead of added here: the next layer's input
        norm (or the model's final norm) adds it in the same pass (``add_rms_norm`` with a
        residual), bitwise the same as ``hidden.add_`` then the norm, one op fewer a layer.
        The returned tensor may be a ``views`` buffer: add it before the next layer runs.
        ``views`` (from ``step_views`` on ``workspace``) may be shared by all layers of a step.
        """
        ws = workspace if workspace is not None else Workspace()
        sv = views if views is not None else self.step_views(ws, hidden)
        self.ensure_linears()
        ops = self.ops
        x = sv.norm  # [T, hidden]
        ops.add_rms_norm(hidden, residual, self.input_layernorm, self.eps, x, ws)
        self.qkv_proj(x, sv.qkv, out_rows_free=True)
        ops.rope_(sv.rope, cos, sin)  # q and k, in place
        attn = self.attn_backend.forward(sv.q, sv.k, sv.v, kv_cache, meta, sv.attn)  # [T, H, d]
        rows = sv.attn_rows if attn is sv.attn else attn.reshape(hidden.shape[0], self.q_size)
        # NOTE: project into the spent norm buffer, then add: bitwise equal to F.linear + add.
        # addmm_ into the residual rounds differently; on the embedded model it drifted to 3e-3
        # max |logit diff| vs transformers (9e-4 this way).
        o = self.o_proj(rows, x, out_is_hint=True, out_rows_free=True)
        # hidden += o-projection, then x = norm(hidden)
        ops.add_rms_norm(hidden, o, self.post_attention_layernorm, self.eps, x, ws)
        # NOTE: a kernel that allocates its output (oneDNN) hands it over instead of copying
        # it into the workspace: at a 2048-token prefill chunk that copy was 12.6 MB a layer.
        gate_up = self.gate_up_proj(x, sv.gate_up, out_is_hint=True, out_rows_free=True)  # [T, 2 I]
        if gate_up is sv.gate_up:
            gate, up = sv.gate, sv.up
        else:
            gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
        act = ops.silu_mul(gate, up, gate_up, sv.act)  # [T, I]
        return self.down_proj(act, x, out_is_hint=True, out_rows_free=True)  # [T, hidden]


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
        # cos / sign-folded sin of positions [0, n) per (device, dtype): [n, 1, d] each.
        self._rope_tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}
        self.linear_plan: LinearPlan | None = None
        self.lm_head_proj: Linear
        self._lm_head_key: tuple[torch.dtype, torch.device] | None = None
        # Quantized "embed_tokens" / "lm_head" sources, set by attach_quantized.
        self.quantized: dict[str, Any] = {}
        # Whether a step may run every layer in one native call (fused_layers.py), and what
        # that call takes per step row count: (the layers' linears_version, args or None).
        self.fused_layers = enabled_by_env()
        self.fused_cache: dict[int, tuple[tuple[int, ...], FusedLayers | None]] = {}
        self.set_native_ops(native.available() if native_ops is None else native_ops)

    @property
    def native_ops(self) -> bool:
        """Whether the layers run norms, RoPE and SiLU with the native CPU kernels."""
        return self.ops is not TORCH_OPS

    def set_native_ops(self, enabled: bool) -> None:
        """Switch the native CPU kernels for norms, RoPE and SiLU on or off (they run on CPU
        tensors; a model moved to another device runs torch ops).

        Raises ValueError when turning them on and they cannot be loaded.
        """
        self._want_native = enabled
        self.ops = layer_ops(native_kernels=enabled, device=self.norm.device)
        for layer in self.layers:
            layer.ops = self.ops

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        out = super()._apply(fn, recurse)
        if self._lm_head_key != (self.lm_head.dtype, self.lm_head.device):
            self._lm_head_key = None
        self.set_native_ops(self._want_native)  # the device may have changed
        return out

    def set_linear_plan(self, plan: LinearPlan | None) -> None:
        """Run the projections with the methods ``plan`` names per weight shape (None: the
        original ``torch.mm`` path); they are rebuilt on next use."""
        self.linear_plan = plan
        self._lm_head_key = None
        for layer in self.layers:
            layer.linear_plan = plan
            layer.invalidate_linears()

    def ensure_linears(self) -> None:
        """Build (prepack) every projection and the lm_head that is not current."""
        for layer in self.layers:
            layer.ensure_linears()
        if self._lm_head_key is None:
            self._build_lm_head()

    def linears(self) -> list[Linear]:
        """Every projection and the lm_head, as built now (built first where needed)."""
        self.ensure_linears()
        return [
            *(
                p
                for lay in self.layers
                for p in (lay.qkv_proj, lay.o_proj, lay.gate_up_proj, lay.down_proj)
            ),
            self.lm_head_proj,
        ]

    def release_packed_weights(self) -> int:
        """Free the layers' weight parameters that only a prepacked copy reads (see
        ``LlamaDecoderLayer.release_packed_weights``); returns the bytes freed.

        NOTE: the memory a prepacked method needs is then held once instead of twice; the
        copy counts as weights wherever weights are counted (``Linear.extra_nbytes``).
        """
        return sum(layer.release_packed_weights() for layer in self.layers)

    def released_weight_bytes(self) -> int:
        """Bytes of the freed weight parameters (held now only as prepacked copies)."""
        return sum(
            getattr(layer, f"{proj}_proj").out_features
            * getattr(layer, f"{proj}_proj").in_features
            * getattr(layer, f"{proj}_weight").element_size()
            for layer in self.layers
            for proj in layer.released
        )

    def build_linears(self) -> list[Linear]:
        """Build (prepack) every projection and the lm_head now; returns them all."""
        built = [lin for layer in self.layers for lin in layer.build_linears()]
        return [*built, self._build_lm_head()]

    def _build_lm_head(self) -> Linear:
        w = self.lm_head  # [vocab, hidden]
        src = self.quantized.get("lm_head", w)
        choice = self.linear_plan.get(tuple(src.shape)) if self.linear_plan is not None else None
        self.lm_head_proj = build_linear(src, act_dtype=w.dtype, device=w.device, choice=choice)
        self._lm_head_key = (w.dtype, w.device)
        return self.lm_head_proj

    def set_attention_backend(self, backend: AttentionBackend | str) -> None:
        """Swap the attention backend of every layer."""
        if isinstance(backend, str):
            backend = get_attention_backend(backend)
        self.attn_backend = backend
        for layer in self.layers:
            layer.attn_backend = backend

    def rope_tables(
        self, num_positions: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin (as ``rope_cos_sin``) of positions ``[0, n)``, ``n >=
        num_positions``, each ``[n, 1, head_dim]``: computed once, grown by doubling.

        NOTE: a step gathers its rows instead of computing cos / sin. Those small
        transcendental ops enter an OpenMP parallel region whose sleeping threads took
        0.3-2.6 ms to wake on a loaded 2-core box (``aten::cos`` was 0.8-1.6 % of a decode
        step under ``torch.profiler``); the gather stays on one thread. Same values bit for
        bit: the table is ``rope_cos_sin`` of those positions.
        """
        key = (device, dtype)
        table = self._rope_tables.get(key)
        if table is None or table[0].shape[0] < num_positions:
            n = max(64, 1 << max(0, num_positions - 1).bit_length())
            positions = torch.arange(n, device=device)
            cos, sin = rope_cos_sin(self._inv_freq_on(device), positions, dtype)
            table = (cos, sin)
            self._rope_tables[key] = table
        return table[0], table[1]

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
        hidden = ws.like("hidden", (input_ids.shape[0], self.arch.hidden_size), emb)  # [T, h]
        if "embed_tokens" in self.quantized:
            embedding_lookup(self.quantized["embed_tokens"], input_ids, hidden)
        else:
            torch.index_select(emb, 0, input_ids, out=hidden)
        if isinstance(positions, FakeTensor):  # traced (memory plan): no table to keep
            cos, sin = rope_cos_sin(self._inv_freq_on(positions.device), positions, emb.dtype, ws)
        else:
            num_positions = max((s.seq_len for s in meta.seqs), default=0)  # positions < it
            cos_table, sin_table = self.rope_tables(num_positions, positions.device, emb.dtype)
            shape = (positions.shape[0], *cos_table.shape[1:])  # [T, 1, d]
            cos = ws.take("rope_cos", shape, emb.dtype, emb.device)
            sin = ws.take("rope_sin", shape, emb.dtype, emb.device)
            torch.index_select(cos_table, 0, positions, out=cos)
            torch.index_select(sin_table, 0, positions, out=sin)
        return self.run_layers(hidden, cos, sin, kv_caches, meta, ws)

    def run_layers(
        self,
        hidden: torch.Tensor,  # [T, hidden] the embedded tokens (updated in place)
        cos: torch.Tensor,  # [T, 1, d]
        sin: torch.Tensor,  # [T, 1, d]
        kv_caches: list[torch.Tensor],  # per layer
        meta: AttentionMetadata,
        ws: Workspace,
    ) -> torch.Tensor:  # [T, hidden], after the final norm, newly allocated
        """Every layer over ``hidden`` (in one native call where the step allows it,
        ``fused_layers.py``), then the final norm (which adds the last MLP output)."""
        views = self.layers[0].step_views(ws, hidden)  # every layer has the same shapes
        residual = run_fused_layers(self, hidden, cos, sin, kv_caches, meta, views)
        if residual is None:
            # NOTE: ``forward`` directly: nn.Module.__call__'s hook checks cost ~2 us a layer.
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                residual = layer.forward(hidden, cos, sin, kv_cache, meta, ws, views, residual)
        out = torch.empty_like(hidden)  # [T, hidden]
        return self.ops.add_rms_norm(hidden, residual, self.norm, self.arch.rms_norm_eps, out, ws)

    def compute_logits(self, hidden: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """Logits [N, vocab] for the rows of ``hidden`` [N, hidden] that sample: float32, or
        with ``keep_dtype`` as the lm_head wrote them (the model's dtype; the sampler widens
        them only where it needs float, see Sampler.sample)."""
        if self._lm_head_key is None:
            self._build_lm_head()
        logits = self.lm_head_proj(hidden)  # [N, vocab]
        return logits if keep_dtype else logits.float()

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into the fused parameters.

        Raises ValueError naming a missing, unexpected or mis-shaped tensor.
        """
        for layer in self.layers:
            layer.restore_weights()  # full-size parameters to copy into
        sd = dict(state_dict)
        used: set[str] = set()
        quantized: dict[str, QuantizedWeight] = {}  # kept as blocks (attach_quantized)

        def take(name: str, target: torch.Tensor) -> None:
            if name not in sd:
                raise ValueError(f"missing weight {name!r}")
            t = sd[name]
            if tuple(t.shape) != tuple(target.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(t.shape)}, expected {tuple(target.shape)}"
                )
            if isinstance(t, QuantizedWeight):
                quantized[name] = t
                used.add(name)
                return
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
        if quantized:
            attach_quantized(self, quantized, sd)
        self.set_linear_plan(self.linear_plan)  # the weights changed: rebuild the methods
        unexpected = sorted(
            k for k in sd if k not in used and not k.endswith("rotary_emb.inv_freq")
        )
        if unexpected:
            raise ValueError(f"unexpected weights: {unexpected[:5]} ({len(unexpected)} total)")
