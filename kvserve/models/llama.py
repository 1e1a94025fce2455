"""Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 / 3, SmolLM) over a
paged KV cache.

One model class serves every family: ``ModelArchConfig`` says where they differ (q/k/v
biases, per-head q/k norms, the RoPE variant, a sliding window, routed experts: Mixtral and
Qwen-MoE; Gemma's sliding and full layers, soft caps, attention scale, extra norms, GeGLU and
scaled embeddings) and the decoder layer takes the parts it names; the loaders hand every
family's weights over under the same names. Layers that attend differently read the step's
metadata as their kind reads it (``runtime/attention/layer_kinds.py``).

The forward pass works on one flattened (ragged) batch of ``T`` tokens from many sequences:
no padding in the linear layers. Attention goes through an ``AttentionBackend`` that writes
the new K/V through the step's slot mapping and reads the context through block tables.

Weights are loaded from HF-named tensors and fused at load time: q/k/v into one
``[(H + 2 * kvh) * d, hidden]`` matrix and gate/up into one ``[2 * intermediate, hidden]``
matrix, so each layer runs four matmuls.

This module holds the model (embedding, the layers, final norm, lm_head, weight loading); one
decoder layer is ``decoder_layer.py``, RoPE ``rope.py``, and the call that runs every layer of
a step at once ``fused_layers.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from kvserve.config import ModelArchConfig
from kvserve.models.decoder_layer import LlamaDecoderLayer, empty_param
from kvserve.models.fused_layers import FusedLayers, enabled_by_env, run_fused_layers
from kvserve.models.gemma_parts import round_to_dtype, soft_cap
from kvserve.models.quant import QuantizedWeight
from kvserve.models.quant_linear import embedding_lookup
from kvserve.models.quant_model import attach_quantized
from kvserve.models.rope import compute_rope, rope_cos_sin
from kvserve.runtime import (
    amx_linear,  # noqa: F401 - registers the AMX linear candidate
    native,
)
from kvserve.runtime.attention import get_attention_backend
from kvserve.runtime.attention.interface import AttentionBackend
from kvserve.runtime.attention.layer_kinds import group_layer_metadata, layer_metadata
from kvserve.runtime.attention.metadata import AttentionMetadata
from kvserve.runtime.autotune.candidates import build_linear
from kvserve.runtime.layer_ops import TORCH_OPS, layer_ops
from kvserve.runtime.linear import Linear, LinearPlan
from kvserve.runtime.triton_ops import cuda_layer_ops
from kvserve.runtime.workspace import Workspace


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
        max_model_len: int | None = None,
    ) -> None:
        """``attn_backend``: a backend or its name (see ``get_attention_backend``; 'auto'
        takes the native CPU kernels where they load on CPU, triton on CUDA). ``native_ops``:
        run norms, RoPE and SiLU with the native CPU kernels (on CPU tensors); None = where
        they load. ``max_model_len``: the context length served (None: the model's); only
        LongRoPE's choice of factors depends on it (``rope.py``).
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
            attn_backend = get_attention_backend(attn_backend, device)
        self.attn_backend = attn_backend
        kw = {"dtype": dtype, "device": device}
        self.embed_tokens = empty_param(arch.vocab_size, arch.hidden_size, **kw)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, attn_backend, layer_idx=i, **kw)
            for i in range(arch.num_hidden_layers)
        )
        self.norm = empty_param(arch.hidden_size, **kw)
        self.lm_head = (
            self.embed_tokens
            if arch.tie_word_embeddings
            else empty_param(arch.vocab_size, arch.hidden_size, **kw)
        )
        # NOTE: kept out of the parameters/buffers so .to(dtype) never lowers its precision.
        self._inv_freq, self.rope_scale = compute_rope(
            arch.head_dim,
            arch.rope_theta,
            arch.rope_scaling,
            max_position_embeddings=arch.max_position_embeddings,
            max_model_len=max_model_len,
        )
        # Gemma 3: the sliding layers rotate with a base of their own (default RoPE).
        self._local_inv_freq: torch.Tensor | None = None
        if arch.local_rope_theta is not None and arch.layer_types is not None:
            self._local_inv_freq, _ = compute_rope(arch.head_dim, arch.local_rope_theta, None)
        # Per layer: its own attention window, and whether it takes the local RoPE.
        self.layer_windows = [arch.layer_window(i) for i in range(arch.num_hidden_layers)]
        self.local_rope_layers = [
            self._local_inv_freq is not None and arch.layer_types[i] == "sliding_attention"
            for i in range(arch.num_hidden_layers)
        ]
        # The attention scale (None: head_dim ** -0.5) and score soft cap every layer uses.
        # NOTE: None where it equals the default (Gemma's query_pre_attn_scalar is mostly
        # head_dim): such layers then read the step's metadata itself.
        self.attention_scale = None if arch.default_attention_scale else arch.attention_scale
        self._inv_freq_by_device: dict[tuple[torch.device, bool], torch.Tensor] = {}
        # cos / sign-folded sin of positions [0, n) per (device, dtype, local): [n, 1, d] each.
        self._rope_tables: dict[tuple[torch.device, torch.dtype, bool], tuple[torch.Tensor, ...]]
        self._rope_tables = {}
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
        if self.ops is TORCH_OPS:
            # NOTE: on CUDA the Triton kernels where triton runs there (one launch an op).
            self.ops = cuda_layer_ops(self.norm.device) or TORCH_OPS
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
        return [*(p for lay in self.layers for p in lay.linears()), self.lm_head_proj]

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
        self, num_positions: int, device: torch.device, dtype: torch.dtype, local: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin (as ``rope_cos_sin``) of positions ``[0, n)``, ``n >=
        num_positions``, each ``[n, 1, head_dim]``: computed once, grown by doubling.
        ``local``: the sliding layers' RoPE (Gemma 3's ``local_rope_theta``).

        NOTE: a step gathers its rows instead of computing cos / sin. Those small
        transcendental ops enter an OpenMP parallel region whose sleeping threads took
        0.3-2.6 ms to wake on a loaded 2-core box (``aten::cos`` was 0.8-1.6 % of a decode
        step under ``torch.profiler``); the gather stays on one thread. Same values bit for
        bit: the table is ``rope_cos_sin`` of those positions.
        """
        key = (device, dtype, local)
        table = self._rope_tables.get(key)
        if table is None or table[0].shape[0] < num_positions:
            n = max(64, 1 << max(0, num_positions - 1).bit_length())
            positions = torch.arange(n, device=device)
            scale = 1.0 if local else self.rope_scale
            cos, sin = rope_cos_sin(self._inv_freq_on(device, local), positions, dtype, scale=scale)
            table = (cos, sin)
            self._rope_tables[key] = table
        return table[0], table[1]

    def _inv_freq_on(self, device: torch.device, local: bool = False) -> torch.Tensor:
        inv = self._inv_freq_by_device.get((device, local))
        if inv is None:
            source = self._local_inv_freq if local else self._inv_freq
            assert source is not None
            inv = source.to(device)
            self._inv_freq_by_device[(device, local)] = inv
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
        if self.arch.scale_embeddings:
            # NOTE: as transformers' Gemma: times sqrt(hidden_size) rounded to the dtype.
            hidden.mul_(round_to_dtype(self.arch.hidden_size**0.5, emb.dtype))
        cos, sin = self._step_rope(positions, meta, ws, emb.dtype, local=False)
        local_rope = None
        if self._local_inv_freq is not None:
            local_rope = self._step_rope(positions, meta, ws, emb.dtype, local=True)
        return self.run_layers(hidden, cos, sin, kv_caches, meta, ws, local_rope)

    def _step_rope(
        self,
        positions: torch.Tensor,  # [T] long
        meta: AttentionMetadata,
        ws: Workspace,
        dtype: torch.dtype,
        local: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [T, 1, d]
        """This step's cos / sin rows (``local``: of the sliding layers' RoPE)."""
        if isinstance(positions, FakeTensor):  # traced (memory plan): no table to keep
            inv_freq = self._inv_freq_on(positions.device, local)
            scale = 1.0 if local else self.rope_scale
            return rope_cos_sin(inv_freq, positions, dtype, ws, scale)
        num_positions = max((s.seq_len for s in meta.seqs), default=0)  # positions < it
        cos_table, sin_table = self.rope_tables(num_positions, positions.device, dtype, local)
        shape = (positions.shape[0], *cos_table.shape[1:])  # [T, 1, d]
        suffix = "_local" if local else ""
        cos = ws.take("rope_cos" + suffix, shape, dtype, positions.device)
        sin = ws.take("rope_sin" + suffix, shape, dtype, positions.device)
        torch.index_select(cos_table, 0, positions, out=cos)
        torch.index_select(sin_table, 0, positions, out=sin)
        return cos, sin

    def run_layers(
        self,
        hidden: torch.Tensor,  # [T, hidden] the embedded tokens (updated in place)
        cos: torch.Tensor,  # [T, 1, d]
        sin: torch.Tensor,  # [T, 1, d]
        kv_caches: list[torch.Tensor],  # per layer
        meta: AttentionMetadata,
        ws: Workspace,
        local_rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # sliding layers' cos, sin
    ) -> torch.Tensor:  # [T, hidden], after the final norm, newly allocated
        """Every layer over ``hidden`` (in one native call where the step allows it,
        ``fused_layers.py``), then the final norm (which adds the last MLP output).

        Each layer reads ``meta`` (with a hybrid KV cache: its group's ``meta.layer_metas``
        entry, that group's tables) as its kind of layer reads it (its window, the attention
        scale and soft cap: ``layer_kinds``) and, where ``local_rope`` is given, the sliding
        layers rotate with it."""
        views = self.layers[0].step_views(ws, hidden)  # every layer has the same shapes
        group_metas = meta.layer_metas  # a hybrid KV cache: each layer its group's metadata
        if group_metas is None:
            metas = layer_metadata(
                meta, self.layer_windows, self.attention_scale, self.arch.attn_logit_softcapping
            )
        else:
            metas = group_layer_metadata(
                group_metas,
                self.layer_windows,
                self.attention_scale,
                self.arch.attn_logit_softcapping,
            )
        residual = None
        if group_metas is None and all(m is meta for m in metas) and local_rope is None:
            residual = run_fused_layers(self, hidden, cos, sin, kv_caches, meta, views)
        if residual is None:
            ropes = [
                local_rope if local_rope is not None and local else (cos, sin)
                for local in self.local_rope_layers
            ]
            # NOTE: ``forward`` directly: nn.Module.__call__'s hook checks cost ~2 us a layer.
            for layer, kv_cache, m, (c, s) in zip(
                self.layers, kv_caches, metas, ropes, strict=True
            ):
                residual = layer.forward(hidden, c, s, kv_cache, m, ws, views, residual)
        out = torch.empty_like(hidden)  # [T, hidden]
        return self.ops.add_rms_norm(hidden, residual, self.norm, self.arch.rms_norm_eps, out, ws)

    def compute_logits(self, hidden: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """Logits [N, vocab] for the rows of ``hidden`` [N, hidden] that sample: float32, or
        with ``keep_dtype`` as the lm_head wrote them (the model's dtype; the sampler widens
        them only where it needs float, see Sampler.sample)."""
        if self._lm_head_key is None:
            self._build_lm_head()
        logits = self.lm_head_proj(hidden)  # [N, vocab]
        cap = self.arch.final_logit_softcapping
        if cap is not None:  # Gemma 2: as transformers, in the lm_head's dtype
            logits = soft_cap(logits, cap)
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

        offset = self.arch.norm_weight_offset

        def take_norm(name: str, target: torch.Tensor) -> None:
            # NOTE: Gemma's RMSNorm multiplies by (1 + w): the parameter holds 1 + w, so every
            # norm kernel stays the plain one (llama.cpp's converter stores w + 1 the same way).
            # Added in the parameter's dtype: exact as transformers in float32.
            take(name, target)
            if offset:
                target.add_(offset)

        def optional_bias(name: str, size: int) -> nn.Parameter | None:
            if name not in sd:
                return None
            p = empty_param(size, dtype=self.norm.dtype, device=self.norm.device)
            take(name, p)
            return p

        take("model.embed_tokens.weight", self.embed_tokens)
        take_norm("model.norm.weight", self.norm)
        if self.arch.tie_word_embeddings:
            used.add("lm_head.weight")  # HF state_dicts list the tied tensor too
        else:
            take("lm_head.weight", self.lm_head)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            qs, kvs = layer.q_size, layer.kv_size
            take_norm(p + "input_layernorm.weight", layer.input_layernorm)
            if layer.attn_out_norm is not None and layer.mlp_out_norm is not None:
                # Gemma: HF's post_attention_layernorm norms the attention output; its
                # pre_feedforward_layernorm is the norm before the MLP.
                take_norm(p + "post_attention_layernorm.weight", layer.attn_out_norm)
                take_norm(p + "pre_feedforward_layernorm.weight", layer.post_attention_layernorm)
                take_norm(p + "post_feedforward_layernorm.weight", layer.mlp_out_norm)
            else:
                take_norm(p + "post_attention_layernorm.weight", layer.post_attention_layernorm)
            w = layer.qkv_weight
            take(p + "self_attn.q_proj.weight", w[:qs])
            take(p + "self_attn.k_proj.weight", w[qs : qs + kvs])
            take(p + "self_attn.v_proj.weight", w[qs + kvs :])
            if self.arch.attention_bias or p + "self_attn.q_proj.bias" in sd:
                layer.qkv_bias = empty_param(qs + 2 * kvs, dtype=w.dtype, device=w.device)
                b = layer.qkv_bias
                take(p + "self_attn.q_proj.bias", b[:qs])
                take(p + "self_attn.k_proj.bias", b[qs : qs + kvs])
                take(p + "self_attn.v_proj.bias", b[qs + kvs :])
            if layer.qk_norm is not None:  # one row per q head, then per k head
                heads = layer.num_heads
                take_norm(p + "self_attn.q_norm.weight", layer.qk_norm[0])
                take_norm(p + "self_attn.k_norm.weight", layer.qk_norm[heads])
                layer.qk_norm[1:heads].copy_(layer.qk_norm[0])
                layer.qk_norm[heads + 1 :].copy_(layer.qk_norm[heads])
            take(p + "self_attn.o_proj.weight", layer.o_weight)
            layer.o_bias = optional_bias(p + "self_attn.o_proj.bias", self.arch.hidden_size)
            if layer.moe is not None:  # router and experts (moe.py)
                layer.moe.load(take, sd, p + "mlp.", quantized, layer.quantized)
                continue
            inter = layer.intermediate_size
            take(p + "mlp.gate_proj.weight", layer.gate_up_weight[:inter])
            take(p + "mlp.up_proj.weight", layer.gate_up_weight[inter:])
            take(p + "mlp.down_proj.weight", layer.down_weight)
            if p + "mlp.gate_proj.bias" in sd:
                layer.gate_up_bias = empty_param(2 * inter, dtype=w.dtype, device=w.device)
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
