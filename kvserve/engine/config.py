"""EngineConfig: the flat set of engine options shared by ``LLM(...)``, the CLI and the server.

Every field becomes a CLI flag (``max_num_seqs`` -> ``--max-num-seqs``), as in vLLM, so the
Python API and the command line cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, fields
from typing import Any, get_args

from kvserve.config import QUANTIZATION_CHOICES, CacheConfig, SchedulerConfig
from kvserve.core.sched.step_budget import PREFILL_POLICIES, StepBudgetConfig
from kvserve.spec_config import SpeculativeConfig

GiB = 1 << 30
# NOTE: kept here (torch-free) and checked against runtime/autotune by a test.
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
KERNEL_SELECTION_MODES = ("auto", "measure", "off")
# NOTE: kept here (torch-free) and checked against runtime/attention by a test.
ATTENTION_BACKEND_CHOICES = ("auto", "native", "torch_sdpa", "torch_ref", "triton")

# NOTE: help texts live beside the fields so `kvserve --help` documents the same names as
# the Python API.
_HELP: dict[str, str] = {
    "model": "GGUF file, HF directory, or Hugging Face Hub id (org/name; org/name:Q4_K_M for one "
    "GGUF of a GGUF repository), fetched into the Hugging Face cache ($HF_HOME; "
    "HF_HUB_OFFLINE=1: the cache only); default: the embedded SmolLM2-135M-Instruct GGUF",
    "dtype": "weight and activation dtype; auto: bfloat16 on a CPU with native bf16 (AMX or "
    "AVX512_BF16) where the kernel measurement finds it faster, else float32; on CUDA "
    "bfloat16 (float16 without bf16)",
    "generation_config": "the model's sampling defaults (vLLM's flag): auto = its "
    "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
    "max_new_tokens) or a GGUF's general.sampling.* keys; vllm = none; or a folder holding a "
    "generation_config.json. A request's own values override them",
    "device": "torch device, e.g. cpu or cuda",
    "seed": "engine seed for unseeded sampling",
    "block_size": "tokens per KV block",
    "num_kv_blocks": "exact KV pool size in blocks (overrides --kv-cache-memory)",
    "kv_cache_memory": "bytes for KV blocks (default: derived from the memory budget)",
    "kv_cache_memory_fraction": "fraction of available memory given to KV blocks when no "
    "size is set",
    "memory_budget": "total bytes for weights + activations + headroom + KV blocks",
    "max_num_seqs": "most requests running at once (capped at max_num_batched_tokens)",
    "max_num_batched_tokens": "token budget per step, shared by prefill chunks and decodes",
    "max_model_len": "longest prompt + output (default: the model's context length)",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes (radix cache)",
    "enable_host_prefix_cache": (
        "keep prefix-cache blocks evicted from the device pool in the host tier (sized by "
        "swap_space, shared with swap preemption) and load them back on a hit"
    ),
    "preemption_mode": "what to do with a request preempted for memory",
    "swap_space": "bytes of host memory for swapped-out KV blocks",
    "kv_cache_dtype": "KV cache element type: auto (= dtype), int8 or fp8 (e4m3), one byte per "
    "element plus a float32 scale per token per KV head",
    "kv_window": "windowed KV eviction (StreamingLLM): keep only the last W tokens of each "
    "request (plus the sink tokens) and free blocks that leave; off by default; disables "
    "prefix caching; changes outputs (measure with `kvserve bench accuracy`)",
    "kv_sink_tokens": "with --kv-window: the first S tokens of each request stay in the cache "
    "and visible (attention sinks)",
    "kv_allocator": "KV block allocation: paged (blocks on demand, prefix sharing) or "
    "contiguous (the naive baseline, for comparison: one run of consecutive blocks per "
    "request sized for prompt + max_tokens, no prefix caching; see core/contiguous.py)",
    "num_threads": "torch CPU threads (default: all cores)",
    "tensor_parallel_size": "shard the model over N workers (torch.distributed: gloo on CPU, "
    "NCCL on CUDA); N must divide the query heads",
    "distributed_executor_backend": "where tensor-parallel workers and data-parallel replicas "
    "run: mp (local processes) or ray (Ray actors)",
    "admission_headroom": "fraction of KV blocks kept free when admitting requests",
    "resume_watermark": "after a preemption, admit again only above this free fraction",
    "quantization": "weight quantization (vLLM's flag): auto (the default) = a GGUF's "
    "quantized tensors run as stored with the int8-dot kernels, or a dense copy where the "
    "start-up measurement finds it faster (an HF model stays dense); none = dequantize at "
    "load; q8_0 / q4_0 / q4_1 = quantize the weights at load to that GGML format",
    "step_budget": "size each step's prefill chunks so the step's predicted time (a cost model "
    "fitted online on the engine's own steps) stays within a target; default (neither flag): "
    "on while that fit predicts this machine's steps (its median relative error at most 0.5), "
    "else the fair prefill share alone; --step-budget: always; --no-step-budget: never; "
    "--max-step-ms or --target-itl-ms imply --step-budget",
    "max_step_ms": "step-time target in ms (default: --step-decode-multiple x the predicted "
    "pure-decode step at the current batch)",
    "target_itl_ms": "inter-token latency target in ms: the step-time target is this minus the "
    "measured time between steps",
    "step_decode_multiple": "default step-time target, as a multiple of the predicted "
    "pure-decode step at the current batch",
    "ttft_aging": "step-budget TTFT guard: a prompt that has waited w seconds for its first "
    "token may stretch a step to the target + this x w (0, the default: a fixed target)",
    "ttft_slack": "step-budget TTFT deadline: a prompt that has waited this multiple of its "
    "predicted unsplit prefill step takes a longer step (--step-deadline-multiple; default 2; "
    "none: no deadline)",
    "step_deadline_multiple": "step budget: a prompt past its TTFT deadline (--ttft-slack) "
    "may stretch the step to this multiple of the predicted pure-decode step (default 2.5; "
    "none: it is not capped at all)",
    "step_tail_fraction": "step budget: the ITL tail allowance, the share of decode tokens "
    "that may fall in steps left uncapped for a long prompt (e.g. 0.012 under a p99 "
    "objective; default: none, every step is capped)",
    "step_tail_min_tokens": "step budget: remaining prompt tokens from which a prompt may spend "
    "the ITL tail allowance (shorter ones are split: a step or two of delay)",
    "step_min_decodes": "step budget: steps with fewer decodes than this are not capped (the "
    "stall falls on so few streams that splitting the prompt costs more)",
    "prefill_policy": "who gets a step's prefill time: shortest remaining prompt first, "
    "round-robin, or fcfs (arrival order)",
    "prefill_share": "fair prefill: while several requests want prefill tokens in a step, "
    "one request's chunk takes at most this share of the tokens the decodes left first (the "
    "rest goes to the others, then back to it), so a new prompt is not held behind a long "
    "one; 1 turns it off (a long prompt's chunks take the whole budget); not applied under "
    "--step-budget, whose plan sizes the chunks",
    "scheduling_policy": "fcfs: the queue is served by priority then arrival, nobody is "
    "preempted for priority; priority (vLLM's name): a waiting request with a smaller "
    "priority value preempts running ones with larger values when it cannot be admitted",
    "max_seats_per_request": "seats the samples of one n > 1 request take "
    "at once while others wait; the rest wait in the queue (default: half the seats)",
    "attention_backend": "paged attention kernels: auto (triton on CUDA where it is installed, "
    "else torch_sdpa; native on CPU where the C++ kernels build, else torch_sdpa), native (C++ "
    "CPU kernels), torch_sdpa, torch_ref (exact, slow) or triton (CUDA, or CPU under "
    "TRITON_INTERPRET=1)",
    "disable_any_whitespace": "structured output: generate JSON compact, with no whitespace "
    "between its tokens (vLLM's structured-outputs option of that name; by default, as vLLM, "
    "any whitespace is allowed there)",
    "enforce_eager": "run every step eagerly: no CUDA graphs (by default, on CUDA with the "
    "triton attention backend, pure-decode steps are captured per batch-size bucket at "
    "start-up and replayed); on CPU there are none and it changes nothing",
    "async_scheduling": "schedule step N+1 while step N's forward runs on a thread of its "
    "own, assuming one new token per running request (vLLM's --async-scheduling); outputs "
    "are those of synchronous scheduling; off by default: no gain was measured on a 2-core "
    "CPU (docs/scheduling.md)",
    "speculative_config": "speculative decoding (vLLM's --speculative-config), as JSON: "
    '{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, '
    '"prompt_lookup_min": M} (prompt lookup) or {"model": PATH, "num_speculative_tokens": K} '
    "(a draft model sharing the tokenizer); greedy output is unchanged, sampled output keeps "
    "its distribution (docs/speculative.md); off by default",
    "batch_invariant": "batch-invariant numerics (on by default): a request's logits, and so "
    "its greedy tokens, do not depend on its batch: the other requests, the step's size, the "
    "chunk its prompt fell in, or a prefix-cache hit, recompute or swap (docs/CONTRACTS.md); "
    "each projection keeps one row-invariant kernel for every M and every prefill row attends "
    "through the paged decode kernel. --no-batch-invariant lets the kernel selection choose "
    "per batch size (docs/kernels.md has the measured difference)",
    "kernel_selection": "projection kernels: auto (measured at start-up, cached under "
    "~/.cache/kvserve), measure (measure again) or off (torch.mm everywhere)",
}


@dataclass(frozen=True)
class EngineConfig:
    """All engine options. Validation happens in the nested configs (ValueError)."""

    model: str | None = None
    dtype: str = "auto"
    generation_config: str = "auto"
    device: str = "cpu"
    seed: int | None = 0  # None: a random seed (unseeded sampling not reproducible)
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float = 0.1
    memory_budget: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_host_prefix_cache: bool = False
    preemption_mode: str = "recompute"
    swap_space: int | None = None
    kv_cache_dtype: str = "auto"
    kv_window: int | None = None
    kv_sink_tokens: int = 0
    kv_allocator: str = "paged"
    num_threads: int | None = None
    admission_headroom: float = 0.02
    resume_watermark: float = 0.10
    quantization: str = "auto"
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    step_budget: bool | None = None  # None: the measured default (core/sched/measured_budget)
    max_step_ms: float | None = None
    target_itl_ms: float | None = None
    step_decode_multiple: float = 1.75
    prefill_policy: str = "shortest"
    # NOTE: issue 51: the engine's defaults are a fixed target with a TTFT deadline (an
    # aging prompt stretched every later step, stalling streams for seconds on the long-
    # prompt probe); StepBudgetConfig keeps issue 21's defaults for the library.
    ttft_aging: float = 0.0
    step_min_decodes: int = 1
    ttft_slack: float | None = 2.0
    step_deadline_multiple: float | None = 2.5
    step_tail_fraction: float | None = None
    step_tail_min_tokens: int = 64
    prefill_share: float = 0.5
    scheduling_policy: str = "fcfs"
    max_seats_per_request: int | None = None
    kernel_selection: str = "auto"
    batch_invariant: bool = True
    attention_backend: str = "auto"
    enforce_eager: bool = False
    async_scheduling: bool = False
    disable_any_whitespace: bool = False
    speculative_config: SpeculativeConfig | None = None  # a dict or its JSON is taken too

    def __post_init__(self) -> None:
        spec = SpeculativeConfig.parse(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        _check_field_types(self)
        if self.seed is None:
            object.__setattr__(self, "seed", int.from_bytes(os.urandom(7), "little"))
        if re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is None:
            raise ValueError(f"device must be 'cpu' or 'cuda' ('cuda:N'), got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                f"got {self.quantization!r}"
            )
        if self.quantization not in ("none", "auto") and not self.device.startswith("cpu"):
            raise ValueError(
                f"quantization={self.quantization!r} runs on CPU only (the int8-dot kernels); "
                f"use quantization='none' or 'auto' (dense there) on {self.device!r}"
            )
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(
            os.path.expanduser(self.generation_config)
        ):
            raise ValueError(
                "generation_config must be 'auto', 'vllm' or a folder holding a "
                f"generation_config.json, got {self.generation_config!r} (no such folder)"
            )
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(
                f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}"
            )
        if self.kernel_selection not in KERNEL_SELECTION_MODES:
            raise ValueError(
                f"unknown kernel_selection {self.kernel_selection!r}; choose one of "
                f"{', '.join(KERNEL_SELECTION_MODES)}"
            )
        if self.attention_backend not in ATTENTION_BACKEND_CHOICES:
            raise ValueError(
                f"unknown attention_backend {self.attention_backend!r}; choose one of "
                f"{', '.join(ATTENTION_BACKEND_CHOICES)}"
            )
        if self.attention_backend != "auto" and self.tensor_parallel_size > 1:
            # NOTE: tensor-parallel workers build their own models with the default backend.
            raise ValueError(
                f"attention_backend={self.attention_backend!r} needs tensor_parallel_size 1 "
                "(tensor-parallel workers run the default backend)"
            )
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError(
                "async_scheduling needs tensor_parallel_size 1 (tensor-parallel steps are "
                "broadcast to the workers from the engine thread)"
            )
        if spec is not None:
            _check_speculation(self)
        if not 0 < self.kv_cache_memory_fraction < 1:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1)")
        if self.kv_window is not None and self.kv_window < 1:
            raise ValueError(f"kv_window must be >= 1, got {self.kv_window}")
        if self.kv_sink_tokens < 0:
            raise ValueError(f"kv_sink_tokens must be >= 0, got {self.kv_sink_tokens}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(
                "distributed_executor_backend must be 'mp' or 'ray', got "
                f"{self.distributed_executor_backend!r}"
            )
        if self.kv_allocator not in ("paged", "contiguous"):
            raise ValueError(
                f"kv_allocator must be 'paged' or 'contiguous', got {self.kv_allocator!r}"
            )
        if self.kv_allocator == "contiguous":
            # NOTE: the windowed and host-tier modes free or move single blocks of a table,
            # which a per-request reservation never does.
            if self.kv_window is not None:
                raise ValueError("kv_allocator='contiguous' cannot be combined with kv_window")
            if self.enable_host_prefix_cache:
                raise ValueError(
                    "kv_allocator='contiguous' has no prefix cache: it cannot be combined with "
                    "enable_host_prefix_cache"
                )
        # Build the nested configs once so their validation runs at construction.
        self.cache_config()
        self.scheduler_config(self.max_model_len or 1)
        self.step_budget_config()
        if self.max_step_ms or self.target_itl_ms:
            # NOTE: a step-time target asks for the budget that enforces it.
            object.__setattr__(self, "step_budget", True)

    def step_budget_config(self) -> StepBudgetConfig:
        """The step-time budget part (its validation names the flags)."""
        return StepBudgetConfig(
            max_step_ms=self.max_step_ms,
            target_itl_ms=self.target_itl_ms,
            decode_multiple=self.step_decode_multiple,
            prefill_policy=self.prefill_policy,
            ttft_aging=self.ttft_aging,
            min_decodes=self.step_min_decodes,
            ttft_slack=self.ttft_slack,
            deadline_multiple=self.step_deadline_multiple,
            tail_fraction=self.step_tail_fraction,
            tail_min_tokens=self.step_tail_min_tokens,
        )

    def cache_config(self) -> CacheConfig:
        """The KV pool part of the options."""
        return CacheConfig(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory=self.kv_cache_memory,
            memory_budget=self.memory_budget,
            kv_cache_dtype=self.kv_cache_dtype,  # type: ignore[arg-type]
            enable_prefix_caching=self.enable_prefix_caching,
            swap_space=self.swap_space,
        )

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduling part, with the model length resolved against the model."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            preemption_mode=self.preemption_mode,  # type: ignore[arg-type]
            admission_headroom=self.admission_headroom,
            resume_watermark=self.resume_watermark,
            scheduling_policy=self.scheduling_policy,  # type: ignore[arg-type]
            max_seats_per_request=self.max_seats_per_request,
            async_scheduling=self.async_scheduling,
            prefill_share=self.prefill_share,
        )

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ---- command line ---------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one ``--flag`` per field to ``parser``."""
        group = parser.add_argument_group("engine")
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            kind = _field_type(f.type)
            if kind is bool:
                group.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=default, help=_HELP[f.name]
                )
                continue
            kwargs: dict[str, Any] = {"default": default, "help": _HELP[f.name]}
            if f.name in ("kv_cache_memory", "memory_budget", "swap_space"):
                kwargs["type"] = parse_bytes
                kwargs["help"] += " (bytes; suffixes K, M, G, KiB, MiB, GiB accepted)"
            elif kind is float and "None" in str(f.type):
                kwargs["type"] = _float_or_none
            else:
                kwargs["type"] = kind
            if f.name == "preemption_mode":
                kwargs["choices"] = ["recompute", "swap"]
            if f.name == "kv_cache_dtype":
                kwargs["choices"] = ["auto", "int8", "fp8"]
            if f.name == "kv_allocator":
                kwargs["choices"] = ["paged", "contiguous"]
            if f.name == "distributed_executor_backend":
                kwargs["choices"] = ["mp", "ray"]
            if f.name == "prefill_policy":
                kwargs["choices"] = list(PREFILL_POLICIES)
            if f.name == "scheduling_policy":
                kwargs["choices"] = ["fcfs", "priority"]
            if f.name == "dtype":
                kwargs["choices"] = list(DTYPE_CHOICES)
            if f.name == "quantization":
                kwargs["choices"] = list(QUANTIZATION_CHOICES)
            if f.name == "kernel_selection":
                kwargs["choices"] = list(KERNEL_SELECTION_MODES)
            if f.name == "attention_backend":
                kwargs["choices"] = list(ATTENTION_BACKEND_CHOICES)
            if f.name == "speculative_config":
                kwargs["type"], kwargs["metavar"] = _speculative_config_arg, "JSON"
            group.add_argument(flag, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        """Build from a namespace filled by :meth:`add_cli_args`."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def _check_field_types(config: EngineConfig) -> None:
    """ValueError naming a field whose value is not of its declared type (a bool is no int;
    an int is a float); ``X | None`` fields take None."""
    for f in fields(config):
        value = getattr(config, f.name)
        optional = "None" in str(f.type)
        if value is None and optional:
            continue
        kind = _field_type(f.type)
        accepted = (int, float) if kind is float else (kind,)
        if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
            allowed = kind.__name__ + (" or None" if optional else "")
            raise ValueError(f"{f.name} must be {allowed}, got {value!r}")


def _check_speculation(config: EngineConfig) -> None:
    """ValueError for what speculative decoding does not combine with (yet)."""
    for name, off in (
        ("async_scheduling", not config.async_scheduling),
        ("tensor_parallel_size", config.tensor_parallel_size == 1),
        ("kv_allocator", config.kv_allocator == "paged"),
        ("kv_window", config.kv_window is None),
    ):
        if not off:
            raise ValueError(
                f"speculative_config cannot be combined with {name}={getattr(config, name)!r} "
                "(speculative decoding runs with synchronous scheduling, one process, the paged "
                "allocator and full attention)"
            )


def _speculative_config_arg(text: str) -> SpeculativeConfig | None:
    """argparse type of ``--speculative-config JSON``: errors name the field."""
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _float_or_none(text: str) -> float | None:
    """An optional number flag's value: ``none`` is None (e.g. ``--ttft-slack none``)."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or none, got {text!r}") from None


def _field_type(annotation: object) -> type:
    text = str(annotation)
    if text.startswith("SpeculativeConfig"):
        return SpeculativeConfig
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if text.startswith(name):
            return kind
    args = get_args(annotation)
    return args[0] if args else str


_SUFFIXES = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "M": 1000**2,
    "MB": 1000**2,
    "G": 1000**3,
    "GB": 1000**3,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
}


def parse_bytes(text: str) -> int:
    """Parse ``"512MiB"``, ``"2G"`` or ``"1048576"`` into bytes (argparse type)."""
    s = text.strip().upper().replace(" ", "")
    num = s.rstrip("KMGIB")
    suffix = s[len(num) :]
    if suffix not in _SUFFIXES or not num:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 512MiB, 2G, 1048576)")
    try:
        value = float(num) * _SUFFIXES[suffix]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}") from e
    if value < 1:
        raise argparse.ArgumentTypeError(f"byte size must be positive: {text!r}")
    return int(value)


def available_memory_bytes() -> int:
    """Memory the process could still use (MemAvailable on Linux, else total RAM)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
