"""What a simulated deployment is: model, hardware, parallelism, engine limits; and results."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvserve.config import SchedulerConfig
from kvserve.sim.cost_model import CostModel, Efficiency
from kvserve.sim.deployment import MemoryPlan, plan_memory
from kvserve.sim.hardware import GiB, HardwareSpec
from kvserve.sim.report import Cell, format_table, kv_header_lines
from kvserve.sim.specs import ModelSpec
from kvserve.sim.workloads import WorkloadRequest, generate_workload


@dataclass(frozen=True)
class SimSetup:
    """One deployment to simulate. ``None`` fields take each experiment's default."""

    model: ModelSpec
    hardware: HardwareSpec
    tp: int = 1
    efficiency: Efficiency = field(default_factory=Efficiency)
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # exact pool size; overrides the memory plan
    swap_space_gib: float = 16.0  # host tier per GPU, for swap preemption
    preemption_mode: str = "recompute"
    prefill_share: float = SchedulerConfig.prefill_share  # the engine's fair prefill share
    enable_prefix_caching: bool = True
    num_requests: int | None = None
    request_rate: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        self.hardware.check_tp(self.tp)
        if self.model.num_heads % self.tp:
            raise ValueError(
                f"tensor parallel degree {self.tp} must divide {self.model.name}'s "
                f"{self.model.num_heads} attention heads"
            )
        if self.seed < 0:  # NOTE: numpy's own message did not name the flag
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if not 0 <= self.swap_space_gib < math.inf:
            raise ValueError(
                f"swap_space_gib must be a finite number >= 0, got {self.swap_space_gib}"
            )
        # NOTE: 0 used to mean "the default" (``x or default`` below), silently.
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        context = self.model.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > context:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds {self.model.name}'s context "
                f"{context} (as the engine refuses it)"
            )

    @property
    def model_len(self) -> int:
        return self.max_model_len or self.model.max_position_embeddings

    def cost_model(self) -> CostModel:
        return CostModel(self.model, self.hardware, self.tp, self.efficiency, self.block_size)

    def memory_plan(self, max_num_seqs: int | None = None) -> MemoryPlan:
        return plan_memory(
            self.model,
            self.hardware,
            self.tp,
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_batched_tokens=max(self.max_num_batched_tokens, self.model_len),
            max_num_seqs=max_num_seqs or self.max_num_seqs,
            swap_space_per_gpu=self.swap_space_gib * GiB,
        )

    def num_blocks(self) -> int:
        """The KV pool size: the override, else the memory plan's."""
        return self.num_kv_blocks or self.memory_plan().num_kv_blocks

    def sched_config(self, **overrides: object) -> SchedulerConfig:
        """The SchedulerConfig of this setup, with per-run overrides."""
        base = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.model_len,
            preemption_mode=self.preemption_mode,  # type: ignore[arg-type]
            prefill_share=self.prefill_share,
        )
        return replace(base, **overrides)  # type: ignore[arg-type]

    def rate(self, default: float = math.inf) -> float:
        return self.request_rate if self.request_rate is not None else default

    def sharegpt(self, num_requests: int, request_rate: float) -> list[WorkloadRequest]:
        """The ShareGPT-like trace, lengths clipped so prompt + output fits max_model_len."""
        max_prompt = min(4096, self.model_len // 2)
        max_output = min(2048, self.model_len - max_prompt)
        return generate_workload(
            "sharegpt",
            num_requests,
            self.seed,
            request_rate=request_rate,
            max_prompt_len=max_prompt,
            max_output_len=max_output,
            vocab_size=self.model.vocab_size,
        )

    def header_lines(self) -> list[str]:
        """KV figures first (every run prints them), then hardware and the memory budget."""
        hw = self.hardware
        lines = kv_header_lines(self.model)
        lines.append(
            f"hardware: {self.tp} x {hw.name} ({hw.memory_bytes / 1e9:.0f} GB, "
            f"{hw.memory_bandwidth / 1e12:.2f} TB/s, {hw.peak_flops / 1e12:.0f} TFLOP/s); "
            f"efficiency flops {self.efficiency.flops:.2f}, bandwidth "
            f"{self.efficiency.bandwidth:.2f}, overhead {self.efficiency.overhead_s * 1e3:.2f} ms"
        )
        try:
            plan = self.memory_plan()
            lines += plan.lines()
        except ValueError as e:
            if self.num_kv_blocks is None:
                raise
            lines.append(f"memory plan: {e}")
        if self.num_kv_blocks is not None:
            lines.append(f"KV pool overridden: {self.num_kv_blocks:,} blocks")
        return lines


@dataclass
class ExperimentResult:
    """A table (and the plot saved beside it) from one experiment."""

    name: str
    title: str
    columns: list[str]
    rows: list[list[Cell]]
    notes: list[str] = field(default_factory=list)
    plot_path: str | None = None

    def text(self) -> str:
        parts = [f"## {self.title}", "", format_table(self.columns, self.rows)]
        if self.notes:
            parts += [""] + [f"- {n}" for n in self.notes]
        if self.plot_path:
            parts += ["", f"plot: {self.plot_path}"]
        return "\n".join(parts)
