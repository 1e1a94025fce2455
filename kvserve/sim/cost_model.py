"""Roofline cost of one engine step on a modelled accelerator.

A step's time is

    max(FLOPs / (peak FLOP/s x eff_flops), bytes / (HBM bandwidth x eff_bandwidth))
    + tensor-parallel all-reduce time + swap (PCIe) time + fixed overhead

per GPU of a tensor-parallel group. FLOPs are the dense GEMMs (2 x active params per token,
plus the lm_head for sampled rows) and attention (4 x layers x heads x head_dim per
(query token, context token) pair, so prefill is quadratic in context). Bytes are the weights
streamed once per step plus the KV cache read by attention and written by the new tokens.
Prefill-heavy steps land on the compute side, decode-heavy steps on the memory side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.core.outputs import SchedulerOutput
from kvserve.sim.hardware import HardwareSpec
from kvserve.sim.specs import ModelSpec


@dataclass(slots=True, frozen=True)
class StepShape:
    """The shape of one step, all the cost model needs to know about it."""

    num_prefill_tokens: int
    num_decode_tokens: int
    num_context_tokens: int  # KV tokens attention reads, summed over sequences (new ones too)
    num_seqs: int
    # Sum over new tokens of the number of tokens each attends to; None = estimate it.
    num_attention_pairs: int | None = None
    num_sampled: int | None = None  # rows through the lm_head; None = num_seqs
    num_swap_blocks: int = 0  # blocks copied host<->device this step
    num_copy_blocks: int = 0  # device-side copy-on-write copies

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def attention_pairs(self) -> float:
        """Exact when given; else assume the tokens and context split evenly over sequences.

        The estimate is exact for pure decode (each token attends to its context) and for a
        single prefill from position 0 (n(n+1)/2).
        """
        if self.num_attention_pairs is not None:
            return float(self.num_attention_pairs)
        if self.num_seqs <= 0 or self.num_tokens <= 0:
            return 0.0
        t = self.num_tokens / self.num_seqs
        c = self.num_context_tokens / self.num_seqs
        return self.num_seqs * (t * max(c - t, 0.0) + t * (t + 1) / 2)

    @classmethod
    def from_scheduler_output(cls, sched: SchedulerOutput) -> StepShape:
        """Shape of a SchedulerOutput: decode = one sampled token past the prompt."""
        num_prefill = num_decode = num_context = num_pairs = num_sampled = 0
        for r in sched.scheduled:
            n = len(r.token_ids)
            start = r.start_pos
            if n == 1 and r.sample and start >= len(r.prompt_token_ids):
                num_decode += 1
            else:
                num_prefill += n
            num_context += start + n
            num_pairs += n * start + n * (n + 1) // 2
            num_sampled += 1 if r.sample else 0
        return cls(
            num_prefill_tokens=num_prefill,
            num_decode_tokens=num_decode,
            num_context_tokens=num_context,
            num_seqs=len(sched.scheduled),
            num_attention_pairs=num_pairs,
            num_sampled=num_sampled,
            num_swap_blocks=len(sched.blocks_to_swap_out) + len(sched.blocks_to_swap_in),
            num_copy_blocks=len(sched.blocks_to_copy),
        )


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of the datasheet peaks, and a fixed per-step overhead."""

    flops: float = 0.6  # fraction of peak dense FLOP/s reached by the GEMMs + attention
    bandwidth: float = 0.8  # fraction of peak HBM bandwidth reached while streaming
    overhead_s: float = 1.5e-3  # per step: launches, scheduling, sampling, host work

    def __post_init__(self) -> None:
        # NOTE: values above 1 are allowed: a calibration fit may land there when the model
        # over-counts the work of a step (e.g. fused kernels that skip a byte stream).
        for name in ("flops", "bandwidth"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v < math.inf):
                raise ValueError(f"Efficiency.{name} must be a finite number > 0, got {v!r}")
        if not 0 <= self.overhead_s < math.inf:
            raise ValueError(f"Efficiency.overhead_s must be >= 0, got {self.overhead_s!r}")


@dataclass(slots=True, frozen=True)
class StepCost:
    """A step's time split by cause (seconds); ``total_s`` is what the clock advances by."""

    compute_s: float
    memory_s: float
    comm_s: float
    swap_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s + self.swap_s + self.overhead_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


class CostModel:
    """Roofline step time of ``model`` on ``tp`` devices of ``hardware``.

    Call it with a SchedulerOutput (``cost_model(sched) -> seconds``) or use
    :meth:`breakdown` with a :class:`StepShape`.
    """

    def __init__(
        self,
        model: ModelSpec,
        hardware: HardwareSpec,
        tp: int = 1,
        efficiency: Efficiency | None = None,
        block_size: int = 16,
    ) -> None:
        hardware.check_tp(tp)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model = model
        self.hardware = hardware
        self.tp = tp
        self.efficiency = efficiency or Efficiency()
        self.block_size = block_size

    # --- what a step does (whole group, before dividing by tp) --------------------------
    @property
    def kv_shards(self) -> int:
        """KV heads split across at most num_kv_heads GPUs; beyond that they are replicated."""
        return min(self.tp, self.model.num_kv_heads)

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        return self.model.kv_bytes_per_token / self.kv_shards

    @property
    def kv_bytes_per_block_per_gpu(self) -> float:
        return self.kv_bytes_per_token_per_gpu * self.block_size

    def linear_flops(self, shape: StepShape) -> float:
        """Dense GEMM FLOPs: 2 x active layer params per token + lm_head for sampled rows."""
        m = self.model
        per_token = m.num_layers * m.layer_params(m.num_experts_per_tok)
        num_sampled = shape.num_seqs if shape.num_sampled is None else shape.num_sampled
        return 2.0 * per_token * shape.num_tokens + 2.0 * m.lm_head_params * num_sampled

    def attention_flops(self, shape: StepShape) -> float:
        """QK^T and PV: 2 x 2 FLOPs per (query token, context token, head, head_dim)."""
        m = self.model
        return 4.0 * m.num_layers * m.num_heads * m.head_dim * shape.attention_pairs()

    def weight_bytes_streamed(self, shape: StepShape) -> float:
        """Weights read once per step; MoE reads only the experts its tokens touch."""
        m = self.model
        experts = float(m.num_experts)
        if m.num_experts > 1:
            # Expected number of distinct experts hit by num_tokens tokens choosing k of E.
            miss = (1.0 - m.num_experts_per_tok / m.num_experts) ** shape.num_tokens
            experts = m.num_experts * (1.0 - miss)
        body = m.num_layers * m.layer_params(experts) + m.lm_head_params + m.hidden_size
        embed_rows = shape.num_tokens * m.hidden_size  # gathered rows of the embedding table
        return (body + embed_rows) * m.dtype_bytes

    def kv_bytes_moved(self, shape: StepShape) -> float:
        """KV read by attention plus KV written for the new tokens."""
        return (shape.num_context_tokens + shape.num_tokens) * self.model.kv_bytes_per_token

    # --- per-GPU times ------------------------------------------------------------------
    def flops_per_gpu(self, shape: StepShape) -> float:
        return (self.linear_flops(shape) + self.attention_flops(shape)) / self.tp

    def bytes_per_gpu(self, shape: StepShape) -> float:
        return (
            self.weight_bytes_streamed(shape) / self.tp
            + self.kv_bytes_moved(shape) / self.kv_shards
        )

    def allreduce_time(self, shape: StepShape) -> float:
        """Ring all-reduce of the hidden states, twice per layer (after attention and MLP)."""
        if self.tp == 1 or shape.num_tokens == 0:
            return 0.0
        hw = self.hardware
        message = shape.num_tokens * self.model.hidden_size * self.model.dtype_bytes
        one = 2.0 * (self.tp - 1) / self.tp * message / hw.interconnect_bandwidth
        return 2 * self.model.num_layers * (one + hw.allreduce_latency_s)

    def swap_time(self, num_swap_blocks: int) -> float:
        """Host<->device copy of blocks; each GPU moves its own shard over its own link."""
        return num_swap_blocks * self.kv_bytes_per_block_per_gpu / self.hardware.host_link_bandwidth

    def breakdown(self, shape: StepShape) -> StepCost:
        """The step's time split into compute, memory, all-reduce, swap and overhead."""
        hw, eff = self.hardware, self.efficiency
        if shape.num_tokens == 0 and shape.num_swap_blocks == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0)
        copy_bytes = 2.0 * shape.num_copy_blocks * self.kv_bytes_per_block_per_gpu
        compute = self.flops_per_gpu(shape) / (hw.peak_flops * eff.flops)
        memory = (self.bytes_per_gpu(shape) + copy_bytes) / (hw.memory_bandwidth * eff.bandwidth)
        if shape.num_tokens == 0:
            compute = memory = 0.0
        return StepCost(
            compute_s=compute,
            memory_s=memory,
            comm_s=self.allreduce_time(shape),
            swap_s=self.swap_time(shape.num_swap_blocks),
            overhead_s=eff.overhead_s,
        )

    def step_time(self, shape: StepShape) -> float:
        """Seconds the virtual clock advances for a step of this shape."""
        return self.breakdown(shape).total_s

    def __call__(self, sched: SchedulerOutput) -> float:
        return self.step_time(StepShape.from_scheduler_output(sched))
