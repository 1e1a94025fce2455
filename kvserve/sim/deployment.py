"""How a model's memory is spent on a tensor-parallel group: weights, activations, KV blocks."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.sim.hardware import GB, GiB, HardwareSpec
from kvserve.sim.specs import ModelSpec


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU budget and the resulting KV pool (blocks are group-wide: one block = one slot
    of ``block_size`` tokens across every layer and every GPU)."""

    num_gpus: int
    usable_bytes_per_gpu: float  # memory x gpu_memory_utilization
    weight_bytes_per_gpu: float
    activation_bytes_per_gpu: float
    kv_bytes_per_gpu: float
    kv_bytes_per_token: int  # whole model (all layers, all GPUs)
    block_size: int
    num_kv_blocks: int
    num_host_blocks: int

    @property
    def max_kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def max_concurrent(self, num_tokens: int) -> int:
        """Requests of ``num_tokens`` tokens that fit the pool at once."""
        per_request = -(-num_tokens // self.block_size)
        return self.num_kv_blocks // per_request

    def lines(self) -> list[str]:
        """Human-readable budget, one figure per line."""
        g = self.num_gpus

        def fmt(b: float) -> str:
            return f"{b / GB:,.2f} GB ({b / GiB:,.2f} GiB)"

        return [
            f"GPUs: {g}; usable memory per GPU {fmt(self.usable_bytes_per_gpu)}",
            f"weights per GPU {fmt(self.weight_bytes_per_gpu)}; "
            f"activations per GPU {fmt(self.activation_bytes_per_gpu)}",
            f"KV per GPU {fmt(self.kv_bytes_per_gpu)}; blocks {self.num_kv_blocks:,} x "
            f"{self.block_size} tokens = {self.max_kv_tokens:,} tokens; "
            f"host blocks {self.num_host_blocks:,}",
        ]


def activation_bytes_per_gpu(
    model: ModelSpec, tp: int, max_num_batched_tokens: int, max_num_seqs: int
) -> float:
    """Estimated peak activation memory of the largest step on one GPU.

    NOTE: an estimate, not a plan: the residual stream and normed input (2 x hidden), the
    sharded q/k/v output, the sharded gate/up/act MLP intermediates (3 x intermediate / tp, for
    the active experts), and float32 logits for every sequence.
    """
    m = model
    qkv = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim / tp
    mlp = 3 * m.intermediate_size * m.num_experts_per_tok / tp
    per_token = (2 * m.hidden_size + qkv + mlp) * m.dtype_bytes
    logits = max_num_seqs * m.vocab_size * 4
    return max_num_batched_tokens * per_token + logits


def plan_memory(
    model: ModelSpec,
    hardware: HardwareSpec,
    tp: int = 1,
    *,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    swap_space_per_gpu: float = 4 * GiB,
) -> MemoryPlan:
    """KV pool size = (memory x utilization x tp - weights - activations) / bytes per block.

    Raises ValueError when the weights and activations leave no room for a single block.
    """
    hardware.check_tp(tp)
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    kv_shards = min(tp, model.num_kv_heads)
    usable = hardware.memory_bytes * gpu_memory_utilization
    weights = model.weight_bytes / tp
    acts = activation_bytes_per_gpu(model, tp, max_num_batched_tokens, max_num_seqs)
    kv = usable - weights - acts
    block_bytes_per_gpu = model.kv_bytes_per_token / kv_shards * block_size
    num_blocks = int(kv // block_bytes_per_gpu) if kv > 0 else 0
    if kv > 0 and num_blocks < 1:  # NOTE: room is left, but not for one block of this size
        raise ValueError(
            f"one KV block of {block_size} tokens ({block_bytes_per_gpu / GB:.1f} GB per GPU) "
            f"does not fit the {kv / GB:.1f} GB left for the KV cache on {tp} x "
            f"{hardware.name}: use a smaller block_size"
        )
    if num_blocks < 1:
        raise ValueError(
            f"{model.name} does not fit {tp} x {hardware.name}: weights {weights / GB:.1f} GB + "
            f"activations {acts / GB:.1f} GB per GPU exceed {usable / GB:.1f} GB usable"
        )
    return MemoryPlan(
        num_gpus=tp,
        usable_bytes_per_gpu=usable,
        weight_bytes_per_gpu=weights,
        activation_bytes_per_gpu=acts,
        kv_bytes_per_gpu=num_blocks * block_bytes_per_gpu,
        kv_bytes_per_token=model.kv_bytes_per_token,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        num_host_blocks=int(swap_space_per_gpu // block_bytes_per_gpu),
    )
