"""Start-up memory budget: weights + activations + headroom + KV blocks.

The KV pool gets every byte the budget leaves after the fixed consumers, and is allocated
once, before any request (seed: "Pre-allocate everything at startup", "Reserve headroom").
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ModelArchConfig
from kvserve.engine_config import GiB, EngineConfig, available_memory_bytes

# NOTE: fixed slack for the allocator, the Python heap, tokenizer and framework state; the
# budget test measures RSS, which includes all of it.
HEADROOM_BYTES = 256 << 20


class MemoryBudgetError(ValueError):
    """The model cannot fit in the budget; the message says how much is missing."""


@dataclass(frozen=True)
class MemoryReport:
    """How the budget is spent; printed at start-up and returned by ``LLM.memory_report()``."""

    weights_bytes: int
    activation_bytes: int
    headroom_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_kv_blocks: int
    num_host_blocks: int
    max_model_len: int
    budget_bytes: int | None

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_kv_blocks * self.block_size * self.kv_bytes_per_token

    @property
    def max_tokens_in_cache(self) -> int:
        return self.num_kv_blocks * self.block_size

    def max_concurrent_requests(self, typical_len: int) -> int:
        """Requests of ``typical_len`` tokens that fit at once (whole blocks each)."""
        blocks_per_req = -(-typical_len // self.block_size)
        return self.num_kv_blocks // blocks_per_req

    def lines(self, typical_len: int = 512) -> list[str]:
        """Human-readable lines, one figure each."""
        mib = 1 << 20
        out = [
            f"weights: {self.weights_bytes / mib:.1f} MiB",
            f"activations (largest step): {self.activation_bytes / mib:.1f} MiB",
            f"headroom: {self.headroom_bytes / mib:.1f} MiB",
            f"KV cache: {self.kv_cache_bytes / mib:.1f} MiB = {self.num_kv_blocks} blocks x "
            f"{self.block_size} tokens x {self.kv_bytes_per_token} bytes/token",
            f"max tokens in cache: {self.max_tokens_in_cache}",
            f"max concurrent requests at {typical_len} tokens: "
            f"{self.max_concurrent_requests(typical_len)}",
        ]
        if self.num_host_blocks:
            out.append(f"host swap tier: {self.num_host_blocks} blocks")
        if self.budget_bytes is not None:
            out.insert(0, f"memory budget: {self.budget_bytes / mib:.1f} MiB")
        return out


def estimate_activation_bytes(
    arch: ModelArchConfig, max_num_batched_tokens: int, max_num_seqs: int, elem_bytes: int
) -> int:
    """Upper estimate of live activation bytes for the largest step the scheduler may issue.

    Per token: the residual stream and norm output, fused qkv, attention output, fused
    gate/up and the SiLU product; plus logits for every sequence that samples.
    """
    h, i = arch.hidden_size, arch.intermediate_size
    qkv = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim
    per_token = (3 * h + qkv + 2 * i + i) * elem_bytes
    logits = max_num_seqs * arch.vocab_size * 4 * 2  # logits + softmax copy (fp32)
    return max_num_batched_tokens * per_token + logits


def plan_kv_blocks(
    config: EngineConfig,
    arch: ModelArchConfig,
    *,
    weights_bytes: int,
    kv_bytes_per_token: int,
    max_model_len: int,
    activation_bytes: int,
    device_free_bytes: int | None = None,
) -> MemoryReport:
    """Decide the number of KV blocks from the options, in this order of precedence:

    ``num_kv_blocks`` > ``kv_cache_memory`` > ``memory_budget`` > a fraction of available
    memory. Raises MemoryBudgetError if not even one max-length request would fit.
    """
    block_bytes = config.block_size * kv_bytes_per_token
    budget = config.memory_budget
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory is not None:
        num_blocks = config.kv_cache_memory // block_bytes
    elif budget is not None:
        free = budget - weights_bytes - activation_bytes - HEADROOM_BYTES
        need = -(-max_model_len // config.block_size) * block_bytes
        if free < need:
            raise MemoryBudgetError(
                f"memory_budget of {budget} bytes is too small: weights {weights_bytes} + "
                f"activations {activation_bytes} + headroom {HEADROOM_BYTES} + one "
                f"max_model_len={max_model_len} request's KV ({need}) need "
                f"{weights_bytes + activation_bytes + HEADROOM_BYTES + need} bytes; "
                f"{need - free} bytes are missing"
            )
        num_blocks = free // block_bytes
    else:
        avail = device_free_bytes if device_free_bytes is not None else available_memory_bytes()
        num_blocks = int(avail * config.kv_cache_memory_fraction) // block_bytes
        num_blocks = min(num_blocks, (16 * GiB) // block_bytes)
    if num_blocks < 1:
        raise MemoryBudgetError(
            f"KV cache gets {num_blocks} blocks of {block_bytes} bytes: give it more memory "
            "(--kv-cache-memory or --num-kv-blocks)"
        )
    if config.swap_space is not None:
        num_host_blocks = config.swap_space // block_bytes
    elif config.preemption_mode == "swap":
        # NOTE: swap mode without a size gets a host tier as large as the device pool, so
        # every running request can be swapped out at least once.
        num_host_blocks = num_blocks
    else:
        num_host_blocks = 0
    return MemoryReport(
        weights_bytes=weights_bytes,
        activation_bytes=activation_bytes,
        headroom_bytes=HEADROOM_BYTES,
        kv_bytes_per_token=kv_bytes_per_token,
        block_size=config.block_size,
        num_kv_blocks=num_blocks,
        num_host_blocks=num_host_blocks,
        max_model_len=max_model_len,
        budget_bytes=budget,
    )
