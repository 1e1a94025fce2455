"""The Llama model on one tensor-parallel rank: its shard, plus the collectives.

``TPLlamaForCausalLM`` is the ordinary ``LlamaForCausalLM`` built with the rank's shapes
(``ShardSpec.local_arch``) and loaded with the rank's slices, with three changes: the
embedding looks up only the rank's vocabulary rows and all-reduces the result; the o and down
projections all-reduce their partial outputs (row-parallel; a MoE layer's expert block
all-reduces its output once, each rank holding a slice of every expert); the lm_head's logits are
gathered on rank 0. The attention, norms and the per-step code are the single-process ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvserve.distributed.comm import TPGroup
from kvserve.distributed.sharding import ShardSpec
from kvserve.models.decoder_layer import LlamaDecoderLayer
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.rope import rope_cos_sin
from kvserve.runtime.attention.metadata import AttentionMetadata
from kvserve.runtime.linear import Linear
from kvserve.runtime.workspace import Workspace


class RowParallelLinear:
    """A row-parallel projection: the rank's partial ``x @ W_r^T``, then an all-reduce."""

    __slots__ = ("inner", "group")

    def __init__(self, inner: Linear, group: TPGroup) -> None:
        self.inner = inner
        self.group = group

    def __call__(
        self, x: torch.Tensor, out: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """``x`` [M, in / N] -> the full [M, out] (summed over the ranks), in the tensor the
        wrapped ``Linear`` returns (``out`` or, where it only takes ``out`` as a hint, its own)."""
        return self.group.all_reduce_(self.inner(x, out, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class TPDecoderLayer(LlamaDecoderLayer):
    """A decoder layer whose o and down projections (or MoE block) all-reduce (set on a
    built layer)."""

    tp_group: TPGroup

    def build_linears(self) -> list[Linear]:
        """The base projections (built from this rank's weights), o and down wrapped."""
        built = super().build_linears()
        self.o_proj = RowParallelLinear(self.o_proj, self.tp_group)  # type: ignore[assignment]
        if self.moe is None:
            self.down_proj = RowParallelLinear(self.down_proj, self.tp_group)  # type: ignore[assignment]
        else:  # the partial outputs of every expert (and the shared one), summed once
            self.moe.all_reduce = self.tp_group.all_reduce_
        return built


class TPLlamaForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` on rank ``spec.rank`` of a tensor-parallel group."""

    def __init__(self, spec: ShardSpec, group: TPGroup, **kwargs: Any) -> None:
        super().__init__(spec.local_arch(), **kwargs)
        self.spec = spec
        self.tp_group = group
        self.full_arch = spec.arch
        self.rank_linear_plan: Any = None  # kernels chosen for this rank's shapes
        for layer in self.layers:
            # NOTE: the layers were built by the base class; switching their class adds the
            # all-reduce to o/down without a second copy of the layer code (no new state).
            layer.__class__ = TPDecoderLayer
            layer.tp_group = group

    def set_linear_plan(self, plan: Any) -> None:
        """The rank's own kernel plan when it has one (the engine passes the full model's)."""
        super().set_linear_plan(
            own if (own := getattr(self, "rank_linear_plan", None)) is not None else plan
        )

    @torch.no_grad()
    def load_sharded(self, state_dict: Mapping[str, Any]) -> None:
        """Slice the full HF-named ``state_dict`` for this rank and load it (before any
        linear method is built: ``load_weights`` rebuilds them from the sliced weights)."""
        self.load_weights(self.spec.shard_state_dict(state_dict))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kvh_r, d]
        meta: AttentionMetadata,
        workspace: Workspace | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        """The base forward with a vocab-parallel embedding lookup."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} layer caches, got {len(kv_caches)}")
        ws = workspace if workspace is not None else Workspace()
        emb = self.embed_tokens  # [V / N, hidden]
        hidden = ws.like("hidden", (input_ids.shape[0], emb.shape[1]), emb)  # [T, hidden]
        start = self.spec.vocab_start
        local = input_ids - start  # [T]
        outside = (local < 0) | (local >= emb.shape[0])  # [T] ids held by other ranks
        torch.index_select(emb, 0, local.masked_fill(outside, 0), out=hidden)
        hidden.masked_fill_(outside[:, None], 0.0)
        self.tp_group.all_reduce_(hidden)
        inv_freq = self._inv_freq_on(positions.device)
        cos, sin = rope_cos_sin(inv_freq, positions, hidden.dtype, ws, self.rope_scale)
        return self.run_layers(hidden, cos, sin, kv_caches, meta, ws)

    def compute_logits(self, hidden: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """Rank 0: the full logits [N, vocab] (float32, whatever ``keep_dtype`` says: the
        gather runs in float32); other ranks: an empty [N, 0]."""
        local = super().compute_logits(hidden)  # [N, V / N]
        full = self.tp_group.gather_to_first(local)  # rank 0: [N, V padded]
        if full is None:
            return local[:, :0]
        return full[:, : self.full_arch.vocab_size]
