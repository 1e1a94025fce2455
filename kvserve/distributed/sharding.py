"""Megatron-style tensor-parallel sharding arithmetic: which rows/columns each rank holds.

- qkv and gate/up: column-parallel (a rank holds some output rows of ``[out, in]``);
- o and down: row-parallel (a rank holds some input columns; partial outputs are all-reduced);
- embedding and lm_head: vocab-parallel (a rank holds ``ceil(V / N)`` vocabulary rows, the
  last rank zero-padded);
- query heads split evenly; KV heads split when ``N`` divides them, replicated when ``N`` is a
  multiple of them (each rank holds the one KV head its query heads use), as in vLLM.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.config import ModelArchConfig

# NOTE: set to 1 to allow more ranks than cores (tests and measurements on a 2-core box).
OVERSUBSCRIBE_ENV = "KVSERVE_TP_ALLOW_OVERSUBSCRIBE"


def available_devices(device: str) -> tuple[int, str]:
    """(how many ranks the device kind can host, its name): CUDA devices or CPU cores."""
    if device.startswith("cuda"):
        return (torch.cuda.device_count() if torch.cuda.is_available() else 0), "CUDA devices"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return cores, "CPU cores"


def validate_tp(arch: ModelArchConfig, tp_size: int, device: str = "cpu") -> None:
    """Raise ValueError naming the numbers when ``tp_size`` cannot shard ``arch`` here."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    if tp_size > 1 and (arch.scale_embeddings or arch.local_rope_theta is not None):
        # NOTE: the rank's forward (tp_model.py) has no embedding scale or local RoPE yet.
        raise ValueError(
            f"tensor_parallel_size {tp_size}: tensor parallelism does not serve "
            f"{arch.architecture} models yet (scaled embeddings, a RoPE per layer type); use 1"
        )
    heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
    if heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} does not divide the model's {heads} query heads"
        )
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp_size} neither divides nor is a multiple of the model's "
            f"{kv_heads} KV heads"
        )
    if arch.intermediate_size % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} does not divide the MLP width {arch.intermediate_size}"
        )
    for what, width in (
        ("expert MLP width", arch.moe_intermediate_size),
        ("shared expert's MLP width", arch.shared_expert_intermediate_size),
    ):
        if arch.num_experts and width % tp_size:
            raise ValueError(f"tensor_parallel_size {tp_size} does not divide the {what} {width}")
    available, what = available_devices(device)
    oversubscribe = not device.startswith("cuda") and os.environ.get(OVERSUBSCRIBE_ENV) == "1"
    if tp_size > available and not oversubscribe:
        raise ValueError(
            f"tensor_parallel_size {tp_size} exceeds the {available} {what} available"
            + (f" (set {OVERSUBSCRIBE_ENV}=1 to oversubscribe)" if what == "CPU cores" else "")
        )


@dataclass(frozen=True)
class ShardSpec:
    """What rank ``rank`` of ``tp_size`` holds of a model of shape ``arch``."""

    arch: ModelArchConfig
    tp_size: int
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank {self.rank} outside [0, {self.tp_size})")

    @property
    def num_heads(self) -> int:
        """Query heads on this rank."""
        return self.arch.num_attention_heads // self.tp_size

    @property
    def head_start(self) -> int:
        """First query head of this rank."""
        return self.rank * self.num_heads

    @property
    def kv_replicated(self) -> bool:
        """Whether KV heads are replicated (more ranks than KV heads)."""
        return self.tp_size > self.arch.num_key_value_heads

    @property
    def num_kv_heads(self) -> int:
        """KV heads on this rank (1 when replicated)."""
        kvh = self.arch.num_key_value_heads
        return 1 if self.kv_replicated else kvh // self.tp_size

    @property
    def kv_head_start(self) -> int:
        """First KV head of this rank: the one its query heads attend with when replicated."""
        if self.kv_replicated:
            return self.rank * self.arch.num_key_value_heads // self.tp_size
        return self.rank * self.num_kv_heads

    @property
    def intermediate(self) -> int:
        """MLP width on this rank."""
        return self.arch.intermediate_size // self.tp_size

    @property
    def vocab_per_rank(self) -> int:
        """Vocabulary rows per rank (the vocabulary padded to a multiple of tp_size)."""
        return -(-self.arch.vocab_size // self.tp_size)

    @property
    def vocab_start(self) -> int:
        """First vocabulary id of this rank."""
        return self.rank * self.vocab_per_rank

    @property
    def vocab_end(self) -> int:
        """One past the last real vocabulary id of this rank."""
        return min(self.vocab_start + self.vocab_per_rank, self.arch.vocab_size)

    def local_arch(self) -> ModelArchConfig:
        """The shapes of this rank's model (its heads, MLP width and vocabulary rows)."""
        return dataclasses.replace(
            self.arch,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate,
            vocab_size=self.vocab_per_rank,
            # NOTE: every rank holds every expert, a 1/N slice of each one's width (vLLM's
            # tensor-parallel MoE); the router is replicated, so all ranks route alike.
            moe_intermediate_size=self.arch.moe_intermediate_size // self.tp_size,
            shared_expert_intermediate_size=self.arch.shared_expert_intermediate_size
            // self.tp_size,
        )

    def shard_state_dict(self, state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """This rank's slices of an HF-named state dict (loadable by ``local_arch()``'s model).

        A quantized weight source (anything with ``dequantize()``) is dequantized first.
        """
        d = self.arch.head_dim
        q0, q1 = self.head_start * d, (self.head_start + self.num_heads) * d
        k0, k1 = self.kv_head_start * d, (self.kv_head_start + self.num_kv_heads) * d
        i0, i1 = self.rank * self.intermediate, (self.rank + 1) * self.intermediate
        out: dict[str, torch.Tensor] = {}
        for name, value in state_dict.items():
            t = value if isinstance(value, torch.Tensor) else value.dequantize()
            out[name] = self._shard_one(name, t, (q0, q1), (k0, k1), (i0, i1))
        return out

    def _shard_one(
        self,
        name: str,
        t: torch.Tensor,
        q: tuple[int, int],
        kv: tuple[int, int],
        inter: tuple[int, int],
    ) -> torch.Tensor:
        base = name.rsplit(".", 1)[0]
        if ".mlp.experts." in name or ".mlp.shared_expert." in name:
            width = (
                self.arch.moe_intermediate_size
                if ".mlp.experts." in name
                else self.arch.shared_expert_intermediate_size
            ) // self.tp_size
            inter = (self.rank * width, (self.rank + 1) * width)  # the expert's own width
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = t[self.vocab_start : self.vocab_end]  # [<= V/N, hidden]
            pad = self.vocab_per_rank - rows.shape[0]
            if pad:
                rows = torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])])
            return rows.clone()
        if base.endswith("q_proj"):
            return t[q[0] : q[1]].clone()  # column-parallel: rows (bias: entries)
        if base.endswith(("k_proj", "v_proj")):
            return t[kv[0] : kv[1]].clone()
        if base.endswith(("gate_proj", "up_proj")):
            return t[inter[0] : inter[1]].clone()
        if base.endswith("o_proj"):
            if t.dim() == 1:  # row-parallel bias: added once, by rank 0
                return t.clone() if self.rank == 0 else torch.zeros_like(t)
            return t[:, q[0] : q[1]].clone()  # row-parallel: input columns
        if base.endswith("down_proj"):
            if t.dim() == 1:
                return t.clone() if self.rank == 0 else torch.zeros_like(t)
            return t[:, inter[0] : inter[1]].clone()
        return t  # norms: replicated
