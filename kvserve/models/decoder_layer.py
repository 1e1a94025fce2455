"""One Llama-family decoder layer: pre-norm attention (fused qkv) + SwiGLU MLP (fused gate/up).

The parts a family adds are taken where its ``ModelArchConfig`` asks: q/k/v biases (Qwen2),
an RMSNorm over each q and k head before RoPE (Qwen3, ``head_rms_norm_``), routed experts in
place of the dense MLP (Mixtral, Qwen-MoE: ``moe.SparseMoeBlock``).

``LlamaDecoderLayer`` holds the layer's weights (linear weights stored transposed, see
``linear_param``) and builds one ``Linear`` per projection (``PROJECTIONS``) from them on first
use; ``StepViews`` are the workspace views every layer of a step shares. The model
(``llama.py``) runs the layers one by one, or all of them in one native call where the step
allows it (``fused_layers.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvserve.config import ModelArchConfig
from kvserve.models.gemma_parts import gelu_tanh_mul
from kvserve.models.moe import SparseMoeBlock
from kvserve.runtime.attention.interface import AttentionBackend
from kvserve.runtime.attention.metadata import AttentionMetadata
from kvserve.runtime.autotune.candidates import build_linear
from kvserve.runtime.layer_ops import TORCH_OPS, LayerOps, RopeViews
from kvserve.runtime.linear import Linear, LinearPlan
from kvserve.runtime.workspace import Workspace

# Each build of a layer's projections takes a new number (LlamaDecoderLayer.build_linears).
LINEAR_VERSIONS = itertools.count(1)


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """A frozen parameter of ``shape`` (uninitialized: the weights are loaded into it)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def linear_param(
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


def head_rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head of ``x`` [T, n, head_dim] (a strided view) in place, scaled by
    ``weight`` [n, head_dim] (each head's row): Qwen3's q and k norms in one pass; returns
    ``x``.

    NOTE: the same arithmetic in the same order as transformers' ``Qwen3RMSNorm`` (float32
    mean of squares, rsqrt, back to the dtype, times the weight), so fp32 results agree bit
    for bit; in-place steps keep it to seven ops (each a few microseconds of dispatch).
    """
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)  # [T, n, 1]
    normed = xf * variance.add_(eps).rsqrt_()
    if normed.dtype != x.dtype:
        normed = normed.to(x.dtype)
    return x.copy_(normed.mul_(weight))


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
    # [T, hidden] the normed attention / MLP output (``sandwich_norms``, Gemma); else None.
    post: torch.Tensor | None = None


class LlamaDecoderLayer(nn.Module):
    """One pre-norm block: attention (fused qkv) + gated MLP (fused gate/up; SwiGLU, or
    GeGLU for Gemma), with Gemma's extra norms of the attention and MLP outputs where the
    config asks (``sandwich_norms``).

    Norm weights hold what multiplies the normed rows: for Gemma's ``(1 + w)`` RMSNorm the
    model loads ``1 + w`` (``LlamaForCausalLM.load_weights``).
    """

    def __init__(
        self,
        arch: ModelArchConfig,
        attn_backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device,
        layer_idx: int = 0,
    ) -> None:
        """``layer_idx``: the layer's index in the model (which layers route to experts)."""
        super().__init__()
        hidden, d = arch.hidden_size, arch.head_dim
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = d
        # NOTE: the step's gate/up buffers (``step_views``) serve the dense MLPs only: a
        # model whose every layer routes to experts (Mixtral) needs none of that width.
        dense_mlp = any(not arch.is_moe_layer(i) for i in range(arch.num_hidden_layers))
        self.intermediate_size = arch.intermediate_size if dense_mlp else 0
        self.eps = arch.rms_norm_eps
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.attn_backend = attn_backend
        kw = {"dtype": dtype, "device": device}
        self.input_layernorm = empty_param(hidden, **kw)
        self.qkv_weight = linear_param(self.q_size + 2 * self.kv_size, hidden, **kw)
        self.register_parameter("qkv_bias", None)
        if arch.qk_norm:
            # NOTE: q_norm's row for each query head, then k_norm's for each KV head: one
            # pass over the q and k heads (``head_rms_norm_``).
            self.qk_norm: nn.Parameter | None = empty_param(
                self.num_heads + self.num_kv_heads, d, **kw
            )
        else:
            self.register_parameter("qk_norm", None)
        self.o_weight = linear_param(hidden, self.q_size, **kw)
        self.register_parameter("o_bias", None)
        # The norm before the MLP (HF's post_attention_layernorm in Llama, Gemma's
        # pre_feedforward_layernorm).
        self.post_attention_layernorm = empty_param(hidden, **kw)
        self.gelu = arch.hidden_act == "gelu_pytorch_tanh"
        if arch.sandwich_norms:
            # Gemma's norms of the attention output (HF: post_attention_layernorm) and of the
            # MLP output (post_feedforward_layernorm), before each joins the residual stream.
            self.attn_out_norm: nn.Parameter | None = empty_param(hidden, **kw)
            self.mlp_out_norm: nn.Parameter | None = empty_param(hidden, **kw)
        else:
            self.register_parameter("attn_out_norm", None)
            self.register_parameter("mlp_out_norm", None)
        # The projections this layer holds (``<name>_weight`` / ``<name>_proj``): a MoE layer's
        # MLP is its ``moe`` block's experts instead of gate_up / down.
        self.projections: tuple[str, ...] = PROJECTIONS
        self.moe: SparseMoeBlock | None = None
        if arch.is_moe_layer(layer_idx):
            self.projections = PROJECTIONS[:2]
            self.moe = SparseMoeBlock(arch, **kw)
        else:
            self.gate_up_weight = linear_param(2 * arch.intermediate_size, hidden, **kw)
            self.down_weight = linear_param(hidden, arch.intermediate_size, **kw)
        self.register_parameter("gate_up_bias", None)
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
        for proj in self.projections:
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
            weight = linear_param(*dense.shape, dtype=placeholder.dtype, device=placeholder.device)
            with torch.no_grad():
                weight.copy_(dense)
            setattr(self, f"{proj}_weight", weight)
        self.released.clear()

    def linears(self) -> list[Linear]:
        """Every projection of the layer (the experts' too), built first where needed."""
        self.ensure_linears()
        built = [getattr(self, f"{proj}_proj") for proj in self.projections]
        if self.moe is not None:
            built += [*self.moe.gate_up_projs, *self.moe.down_projs, *(self.moe.shared_projs or ())]
        return built

    def build_linears(self) -> list[Linear]:
        """Build the projections from the weights (per ``linear_plan``; four, or qkv and o and
        the experts' in a MoE layer); returns them."""
        self.restore_weights()
        w = self.qkv_weight
        kw = {"act_dtype": w.dtype, "device": w.device}
        plan = self.linear_plan

        def make(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
            choice = plan.get(tuple(weight.shape)) if plan is not None else None
            return build_linear(weight, bias, choice=choice, **kw)

        q = self.quantized
        built = []
        for proj in self.projections:
            weight = q.get(proj, getattr(self, f"{proj}_weight"))
            built.append(make(weight, getattr(self, f"{proj}_bias")))
            setattr(self, f"{proj}_proj", built[-1])
        if self.moe is not None:
            # NOTE: the experts take no method from the plan: a prepacked copy per expert
            # would hold every expert twice (their parameters are not released), and the
            # plan's shapes are the dense MLP's. torch.mm, or the int8-dot kernel on blocks.
            built += self.moe.build_linears(lambda w, b: build_linear(w, b, **kw), q)
        self._linears_key = (w.dtype, w.device)
        self.linears_version = next(LINEAR_VERSIONS)
        return built

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
            post=None if self.attn_out_norm is None else ws.like("post", hidden.shape, hidden),
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
        if self.qk_norm is not None:
            head_rms_norm_(sv.rope.x, self.qk_norm, self.eps)  # q and k heads, in place
        ops.rope_(sv.rope, cos, sin)  # q and k, in place
        attn = self.attn_backend.forward(sv.q, sv.k, sv.v, kv_cache, meta, sv.attn)  # [T, H, d]
        rows = sv.attn_rows if attn is sv.attn else attn.reshape(hidden.shape[0], self.q_size)
        # NOTE: project into the spent norm buffer, then add: bitwise equal to F.linear + add.
        # addmm_ into the residual rounds differently; on the embedded model it drifted to 3e-3
        # max |logit diff| vs transformers (9e-4 this way).
        o = self.o_proj(rows, x, out_is_hint=True, out_rows_free=True)
        if self.attn_out_norm is not None:  # Gemma: the output normed before it is added
            assert sv.post is not None
            o = ops.add_rms_norm(o, None, self.attn_out_norm, self.eps, sv.post, ws)
        # hidden += o-projection, then x = norm(hidden)
        ops.add_rms_norm(hidden, o, self.post_attention_layernorm, self.eps, x, ws)
        if self.moe is not None:
            return self.moe.forward(x, ops)  # [T, hidden] routed experts (moe.py)
        # NOTE: a kernel that allocates its output (oneDNN) hands it over instead of copying
        # it into the workspace: at a 2048-token prefill chunk that copy was 12.6 MB a layer.
        gate_up = self.gate_up_proj(x, sv.gate_up, out_is_hint=True, out_rows_free=True)  # [T, 2 I]
        if gate_up is sv.gate_up:
            gate, up = sv.gate, sv.up
        else:
            gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
        if self.gelu:
            act = gelu_tanh_mul(gate, up, sv.act)  # [T, I]
        else:
            act = ops.silu_mul(gate, up, gate_up, sv.act)  # [T, I]
        down = self.down_proj(act, x, out_is_hint=True, out_rows_free=True)  # [T, hidden]
        if self.mlp_out_norm is None:
            return down
        assert sv.post is not None
        return ops.add_rms_norm(down, None, self.mlp_out_norm, self.eps, sv.post, ws)
