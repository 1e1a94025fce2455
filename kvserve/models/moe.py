"""The mixture-of-experts MLP part of a decoder layer (Mixtral, Qwen2-MoE, Qwen3-MoE).

``SparseMoeBlock`` replaces the dense SwiGLU MLP of the layers ``ModelArchConfig.is_moe_layer``
names. Per step of ``T`` tokens:

1. **Route, in fp32.** ``logits = x @ router.T`` with ``x`` and the router in float32 whatever
   the model's dtype; softmax over the experts; the top ``k`` per token; renormalized to sum
   to 1 where ``norm_topk_prob`` (Mixtral always, Qwen-MoE where the config says). Qwen2-MoE's
   shared-expert gate is one more router row (its sigmoid scales the shared expert).
2. **Group by expert.** The ``T * k`` (token, expert) pairs are sorted by expert (stable, so
   each expert's tokens stay in order) and their rows gathered once (``index_select``).
3. **One GEMM pair per active expert**: gate/up, SiLU * up, down, over that expert's
   contiguous rows; experts no token chose are skipped.
4. **Scatter back**: each row times its routing weight, summed into its token's output
   (``index_add_``, in expert order per token: transformers' order of accumulation).

Each expert's projections are ``Linear``s built like the dense layers' (``build_linear``), so
an expert held in GGML blocks (GGUF, ``--quantization``) runs as stored on the same int8-dot
kernels. The dense weights are stacked ``[E, out, in]`` parameters, stored transposed per
expert as ``linear_param`` stores a dense weight.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from kvserve.config import ModelArchConfig
from kvserve.models.quant import QuantizedWeight
from kvserve.runtime.layer_ops import LayerOps
from kvserve.runtime.linear import Linear

# (weight source, bias) -> a Linear, as the decoder layer builds its projections.
MakeLinear = Callable[[Any, torch.Tensor | None], Linear]
# take(name, target): copy state-dict tensor ``name`` into ``target`` (checking its shape).
Take = Callable[[str, torch.Tensor], None]


def stacked_linear_param(
    num: int, out_features: int, in_features: int, *, dtype: torch.dtype, device: torch.device
) -> nn.Parameter:
    """``num`` linear weights ``[num, out, in]``, each stored transposed (``w[e].t()`` is
    contiguous), as ``decoder_layer.linear_param`` stores one."""
    storage = torch.empty(num, in_features, out_features, dtype=dtype, device=device)
    return nn.Parameter(storage.transpose(1, 2), requires_grad=False)


def _dropped(like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(0, dtype=like.dtype, device=like.device), requires_grad=False)


class SparseMoeBlock(nn.Module):
    """Top-k routed SwiGLU experts, plus Qwen2-MoE's gated shared expert (module docstring)."""

    def __init__(self, arch: ModelArchConfig, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        e, h, i = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size
        self.num_experts, self.top_k, self.inter = e, arch.num_experts_per_tok, i
        self.norm_topk_prob = arch.norm_topk_prob
        self.shared_inter = arch.shared_expert_intermediate_size
        kw = {"dtype": dtype, "device": device}
        # NOTE: float32 always: the router's logits decide which experts run, and a bf16
        # matmul there flips near-ties (vLLM and llama.cpp route in fp32 too).
        rows = e + (1 if self.shared_inter else 0)  # + the shared-expert gate's row
        self.router = nn.Parameter(
            torch.empty(rows, h, dtype=torch.float32, device=device), requires_grad=False
        )
        self.experts_gate_up = stacked_linear_param(e, 2 * i, h, **kw)  # [E, 2I, h]
        self.experts_down = stacked_linear_param(e, h, i, **kw)  # [E, h, I]
        self.shared_gate_up: nn.Parameter | None = None
        self.shared_down: nn.Parameter | None = None
        if self.shared_inter:
            self.shared_gate_up = stacked_linear_param(1, 2 * self.shared_inter, h, **kw)
            self.shared_down = stacked_linear_param(1, h, self.shared_inter, **kw)
        self.gate_up_projs: list[Linear] = []
        self.down_projs: list[Linear] = []
        self.shared_projs: tuple[Linear, Linear] | None = None
        # Tensor parallel: sums the ranks' partial outputs (each rank holds a slice of every
        # expert's width), set by ``distributed/tp_model.py``; None in one process.
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        router = self.router
        out = super()._apply(fn, recurse)
        if self.router.dtype != torch.float32:  # .to(dtype) moves the router, never lowers it
            self.router = nn.Parameter(
                router.detach().to(self.router.device, torch.float32), requires_grad=False
            )
        return out

    # ---- weights -----------------------------------------------------------------------

    def load(
        self,
        take: Take,
        state_dict: MutableMapping[str, Any],
        prefix: str,
        quantized: Mapping[str, QuantizedWeight],
        sources: MutableMapping[str, Any],
    ) -> None:
        """Copy this layer's MoE tensors (``prefix``: ``model.layers.N.mlp.``) in with
        ``take``; the quantized ones (``quantized``, filled by ``take``) become weight
        sources in ``sources`` (the layer's ``quantized``: ``experts.gate_up.{e}``, ...)
        and the dense parameters they replace are dropped."""
        from kvserve.models.quant_linear import fuse_weights, kernel_layout

        e, i = self.num_experts, self.inter
        for name in (prefix + "gate.weight", prefix + "shared_expert_gate.weight"):
            if isinstance(state_dict.get(name), QuantizedWeight):  # routers stay fp32
                state_dict[name] = state_dict[name].dequantize(torch.float32)
        take(prefix + "gate.weight", self.router[:e])
        names: dict[str, tuple[list[str], list[str]]] = {}
        for x in range(e):
            p = f"{prefix}experts.{x}."
            take(p + "gate_proj.weight", self.experts_gate_up[x, :i])
            take(p + "up_proj.weight", self.experts_gate_up[x, i:])
            take(p + "down_proj.weight", self.experts_down[x])
            names[f"experts.gate_up.{x}"] = ([p + "gate_proj.weight", p + "up_proj.weight"], [])
            names[f"experts.down.{x}"] = ([p + "down_proj.weight"], [])
        if self.shared_gate_up is not None and self.shared_down is not None:
            s, p = self.shared_inter, prefix + "shared_expert."
            take(prefix + "shared_expert_gate.weight", self.router[e:])
            take(p + "gate_proj.weight", self.shared_gate_up[0, :s])
            take(p + "up_proj.weight", self.shared_gate_up[0, s:])
            take(p + "down_proj.weight", self.shared_down[0])
            names["shared.gate_up"] = ([p + "gate_proj.weight", p + "up_proj.weight"], [])
            names["shared.down"] = ([p + "down_proj.weight"], [])
        held = {k: v[0] for k, v in names.items() if any(n in quantized for n in v[0])}
        for key, parts in held.items():
            sources[key] = kernel_layout(fuse_weights([state_dict[n] for n in parts]))
        # NOTE: a stacked parameter goes once every expert in it is held in blocks (a GGUF
        # tensor holds all of them in one type); a partly quantized stack keeps its dense
        # rows for the experts that read them.
        if all(f"experts.gate_up.{x}" in held for x in range(e)):
            self.experts_gate_up = _dropped(self.experts_gate_up)
        if all(f"experts.down.{x}" in held for x in range(e)):
            self.experts_down = _dropped(self.experts_down)
        if "shared.gate_up" in held and self.shared_gate_up is not None:
            self.shared_gate_up = _dropped(self.shared_gate_up)
        if "shared.down" in held and self.shared_down is not None:
            self.shared_down = _dropped(self.shared_down)

    def build_linears(self, make: MakeLinear, sources: Mapping[str, Any]) -> list[Linear]:
        """One ``Linear`` per expert projection (and the shared expert's), from the held
        blocks in ``sources`` or the dense parameters; returns them all."""
        self.gate_up_projs = [
            make(sources.get(f"experts.gate_up.{x}", self._row(self.experts_gate_up, x)), None)
            for x in range(self.num_experts)
        ]
        self.down_projs = [
            make(sources.get(f"experts.down.{x}", self._row(self.experts_down, x)), None)
            for x in range(self.num_experts)
        ]
        built = [*self.gate_up_projs, *self.down_projs]
        if self.shared_gate_up is not None and self.shared_down is not None:
            gate_up = make(sources.get("shared.gate_up", self._row(self.shared_gate_up, 0)), None)
            down = make(sources.get("shared.down", self._row(self.shared_down, 0)), None)
            self.shared_projs = (gate_up, down)
            built += [gate_up, down]
        return built

    @staticmethod
    def _row(stack: torch.Tensor, index: int) -> torch.Tensor | None:
        return stack[index] if stack.numel() else None  # a dropped stack: the blocks serve

    # ---- forward -----------------------------------------------------------------------

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Routing of ``x`` [T, h]: the top-k weights [T, k] (fp32) and experts [T, k]
        (int64), and the router's fp32 logits [T, rows] (the shared gate's last)."""
        logits = torch.mm(x.float(), self.router.t())  # [T, E (+1)]
        probs = torch.softmax(logits[:, : self.num_experts], dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, experts, logits

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:  # [T, h] -> [T, h]
        """The MoE MLP of ``x`` [T, h] (the post-attention normed hidden state); a new tensor."""
        weights, experts, logits = self.route(x)
        num_tokens, k = experts.shape
        flat = experts.reshape(-1)  # [T k]
        order = torch.argsort(flat, stable=True)  # pair rows grouped by expert
        tokens = torch.div(order, k, rounding_mode="floor")  # [T k] token of each pair row
        if isinstance(x, FakeTensor):
            # NOTE: traced (memory plan): the counts are data. Every token choosing the same
            # k experts is the worst step: an expert never gets more than T rows.
            counts = [num_tokens] * k + [0] * (self.num_experts - k)
        else:
            counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, tokens)  # [T k, h] grouped by expert
        ys = torch.empty_like(rows)  # [T k, h]
        start = 0
        for e, n in enumerate(counts):
            if n:
                end = start + n
                self.down_projs[e](
                    self._act(self.gate_up_projs[e](rows[start:end]), ops), ys[start:end]
                )
                start = end
        ys.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(1).to(ys.dtype))
        out = torch.zeros_like(x)
        out.index_add_(0, tokens, ys)
        if self.shared_projs is not None:
            gate_up, down = self.shared_projs
            shared = down(self._act(gate_up(x), ops))  # [T, h]
            gate = torch.sigmoid(logits[:, self.num_experts :]).to(shared.dtype)  # [T, 1]
            out.add_(shared.mul_(gate))
        return out if self.all_reduce is None else self.all_reduce(out)

    @staticmethod
    def _act(gate_up: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """SiLU(gate) * up of ``gate_up`` [n, 2I] (gate rows first) -> [n, I]."""
        inter = gate_up.shape[1] // 2
        out = gate_up.new_empty((gate_up.shape[0], inter))
        return ops.silu_mul(gate_up[:, :inter], gate_up[:, inter:], gate_up, out)
