"""Start-up memory budget: weights + activations + headroom + KV blocks.

The KV pool gets every byte the budget leaves after the fixed consumers, and is allocated
once, before any request (seed: "Pre-allocate everything at startup", "Reserve headroom").

    budget = weights + activations (planned, runtime/memory_plan/) + kernel scratch
             + headroom + KV blocks
             [+ the host swap tier when the device is the CPU: it lives in the same RAM]

Kernel scratch (``runtime/kernel_scratch.py``) is what kernels take for themselves: CPU flash
attention's per-thread buffers are modelled per op inside the activation plan; the GEMM
library's buffers (MKL keeps them across calls) are measured at start-up by running the
planned steps' GEMM shapes once, and are their own term of the budget.

The budget is for the whole process, as the OS counts it (peak RSS on CPU), so the headroom
covers what is not a tensor of ours: the Python interpreter, torch's libraries, the tokenizer,
allocator slack. Tracing the activation plan imports ``torch._dynamo`` (and, where triton is
installed, triton's ~100 MiB library): on the CPU that growth is measured around the trace
and added to the headroom (0 when the plan is read back from disk). Loading briefly holds
the weights twice (the loader's state dict and the model's fused parameters), so a budget
must also cover a load headroom + 2 x weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from kvserve.config import ModelArchConfig
from kvserve.core.kv.kv_groups import KVGroupSpec, hybrid_blocks_per_request, window_blocks
from kvserve.engine.config import EngineConfig, GiB, available_memory_bytes
from kvserve.runtime.kernel_scratch import GemmShape, measure_gemm_scratch, resident_bytes
from kvserve.runtime.kv_cache import kv_bytes_per_token
from kvserve.runtime.memory_plan.planner import ActivationPlan, plan_activations
from kvserve.runtime.native.chunk_limit import ChunkAttention

MiB = 1 << 20
T = TypeVar("T")

# NOTE: measured, not guessed (`kvserve bench memory --measure`): peak RSS while generating
# minus weights, KV pool and the planned activation reserve, plus ~20% slack. The figures:
# bench/README.md, "Measurements behind constants in the code".
HEADROOM_BYTES = 576 * MiB
# Peak RSS while loading minus the weights twice (the loader's state dict and the model's
# fused parameters are both alive while the weights are copied), measured the same way,
# plus ~30% slack (same section of bench/README.md).
LOAD_HEADROOM_BYTES = 384 * MiB

# NOTE: the traced model keeps this many layers. Llama layers are identical and no tensor
# of one layer outlives the next, so two layers (one layer boundary) show the same peak as
# all of them (test_memory_plan checks it on the embedded model) at a fifteenth of the cost.
TRACE_LAYERS = 2


class MemoryBudgetError(ValueError):
    """The model cannot fit in the budget; the message says how much is missing."""


@dataclass(frozen=True)
class MemoryReport:
    """How the budget is spent; printed at start-up and returned by ``LLM.memory_report()``."""

    weights_bytes: int
    activation_bytes: int  # reserved for the largest step (planned arena or eager peak)
    headroom_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_kv_blocks: int
    num_host_blocks: int
    max_model_len: int
    budget_bytes: int | None
    activation_plan: ActivationPlan | None = None
    # GEMM library buffers, measured at start-up (None: not measured, as without a budget).
    kernel_scratch_bytes: int | None = None
    # Of ``weights_bytes``: the projection kernels' own weight copies (prepacked layouts).
    packed_weights_bytes: int = 0
    # Of ``headroom_bytes``: what tracing the activation plan left resident (its imports).
    tracing_bytes: int = 0
    # Hybrid KV cache (core/kv/kv_groups.py): its groups, and the largest chunk a step gives
    # a request (bounds a sliding group's blocks). A block then holds one group's layers
    # (``kv_bytes_per_token`` is per block id: ``group_size`` layers).
    kv_groups: tuple[KVGroupSpec, ...] | None = None
    max_chunk: int = 1

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_kv_blocks * self.block_size * self.kv_bytes_per_token

    @property
    def host_cache_bytes(self) -> int:
        return self.num_host_blocks * self.block_size * self.kv_bytes_per_token

    @property
    def max_tokens_in_cache(self) -> int:
        """Tokens the pool holds: of all requests together; with a hybrid KV cache, of one
        request (its full-attention groups' blocks once its sliding groups have theirs)."""
        groups = self.kv_groups
        if not groups:
            return self.num_kv_blocks * self.block_size
        bs, chunk = self.block_size, self.max_chunk
        sliding = sum(window_blocks(g.window, bs, chunk) for g in groups if g.window)
        num_full = sum(1 for g in groups if g.window is None)
        if num_full == 0:
            return self.max_model_len
        return max(0, self.num_kv_blocks - sliding) // num_full * self.block_size

    def max_concurrent_requests(self, typical_len: int) -> int:
        """Requests of ``typical_len`` tokens that fit at once (whole blocks each).

        With a hybrid KV cache, per group: a decoding request holds all its blocks in a full
        group and ``window_blocks(W, bs)`` in a sliding one; a step's prefill chunk (at most
        ``max_chunk`` tokens) makes one request's sliding groups hold its whole chunk for
        that step, which is kept free once.
        """
        if typical_len < 1:
            raise ValueError(f"typical_len must be >= 1, got {typical_len}")
        groups, bs = self.kv_groups, self.block_size
        if not groups:
            return self.num_kv_blocks // -(-typical_len // bs)
        per_request = hybrid_blocks_per_request(groups, bs, typical_len, 1)
        chunk = hybrid_blocks_per_request(groups, bs, typical_len, self.max_chunk) - per_request
        return max(0, self.num_kv_blocks - chunk) // per_request

    def lines(self, typical_len: int = 512) -> list[str]:
        """Human-readable lines, one figure each."""
        out = []
        if self.budget_bytes is not None:
            out.append(f"memory budget: {_fmt(self.budget_bytes)}")
        packed = self.packed_weights_bytes
        held = f" (of which prepacked kernel copies: {_fmt(packed)})" if packed else ""
        out.append(f"weights: {_fmt(self.weights_bytes)}{held}")
        out.append(f"activations (largest step): {_fmt(self.activation_bytes)}")
        plan = self.activation_plan
        if plan is not None:
            out += [
                f"  planned activation peak: {_fmt(plan.planned_peak_bytes)}",
                f"  eager activation peak: {_fmt(plan.eager_peak_bytes)}",
                f"  activation lower bound: {_fmt(plan.lower_bound_bytes)}",
                f"  naive activation sum: {_fmt(plan.naive_bytes)} "
                f"({plan.num_layers_traced} layers traced)",
                f"  of which kernel scratch (attention kernels, {plan.num_threads} threads, "
                f"modelled): {_fmt(plan.kernel_scratch_bytes)}",
                f"  largest step: {plan.step_name} ({plan.num_tokens} tokens, "
                f"{plan.num_seqs} sequences)",
            ]
        scratch = self.kernel_scratch_bytes
        out += [
            "kernel scratch (GEMM library buffers, measured at start-up): "
            + (_fmt(scratch) if scratch is not None else "not measured (no memory budget)"),
            f"headroom: {_fmt(self.headroom_bytes)}",
            *(
                [f"  of which the plan's trace (its imports, measured): {_fmt(self.tracing_bytes)}"]
                if self.tracing_bytes
                else []
            ),
            f"KV cache: {_fmt(self.kv_cache_bytes)} = {self.num_kv_blocks} blocks x "
            f"{self.block_size} tokens x {self.kv_bytes_per_token} bytes/token",
            f"max tokens in cache: {self.max_tokens_in_cache}",
            f"max concurrent requests at {typical_len} tokens: "
            f"{self.max_concurrent_requests(typical_len)}",
        ]
        if self.num_host_blocks:
            out.append(
                f"host swap tier: {self.num_host_blocks} blocks ({_fmt(self.host_cache_bytes)})"
            )
        return out


def _fmt(num_bytes: int) -> str:
    return f"{num_bytes / MiB:.1f} MiB ({num_bytes} bytes)"


# NOTE: "auto" is resolved by the engine before it plans (runtime/autotune); a config planned
# without an engine counts float32, the larger of the dtypes "auto" can choose on CPU.
_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": torch.float32,
}


def model_weights_bytes(arch: ModelArchConfig, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of ``LlamaForCausalLM(arch)``'s parameters (tied ones once), without loading.

    Lets the budget be checked before the weights are read.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kvserve.models.llama import LlamaForCausalLM

    with FakeTensorMode():
        model = LlamaForCausalLM(arch, dtype=dtype)
        total = sum(p.numel() * p.element_size() for p in model.parameters())
    if arch.attention_bias:  # q/k/v biases are created when the weights are loaded
        qkv = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim
        total += arch.num_hidden_layers * qkv * torch.tensor([], dtype=dtype).element_size()
    return total


def measure_growth(device: str, compute: Callable[[], T]) -> tuple[T, int]:
    """``compute()``'s result and the resident bytes it left behind on the CPU.

    0 on an accelerator (its budget is its own memory) or where the OS tells no resident
    size. NOTE: for the plan's trace, whose fake tensors allocate nothing: what stays is
    ``torch._dynamo``'s imports, paid once per process (0 on a plan read back from disk).
    """
    before = resident_bytes() if torch.device(device).type == "cpu" else None
    value = compute()
    after = resident_bytes() if before is not None else None
    return value, max(0, after - before) if before is not None and after is not None else 0


def plan_step_activations(
    config: EngineConfig,
    arch: ModelArchConfig,
    *,
    max_model_len: int,
    max_layers: int | None = TRACE_LAYERS,
    chunk_attention: ChunkAttention | None = None,
) -> ActivationPlan:
    """Plan the activations of the largest step ``config``'s scheduler may issue.

    Traces (on fake tensors: nothing of the model's size is allocated) the worst-case
    prefill, decode and mixed steps (and a speculative one, ``speculative_rows``) under
    max_num_batched_tokens / max_num_seqs / max_model_len (or the pool's size, see
    ``max_sequence_tokens``), with ``max_layers`` layers of the model (None = all), with the
    native backend's ``chunk_attention`` choice (the engine's; None: the backend's defaults).
    """
    from kvserve.models.llama import LlamaForCausalLM

    return plan_activations(
        arch,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_sequence_tokens(config, arch, max_model_len=max_model_len),
        block_size=config.block_size,
        dtype=_DTYPES[config.dtype],
        device=config.device,
        max_layers=max_layers,
        num_threads=config.num_threads,
        model_factory=LlamaForCausalLM,
        chunk_attention=chunk_attention,
        speculative=speculative_rows(config),
    )


def speculative_rows(config: EngineConfig) -> tuple[int, int] | None:
    """(the most requests that speculate in one step, draft tokens each) under ``config``'s
    speculative decoding, None without it: each such request samples ``1 + k`` rows, which
    the plan's ``speculate`` step sizes the logits for (``speculate.py``: no drafts at or
    past ``disable_by_batch_size`` running requests)."""
    spec = config.speculative_config
    if spec is None:
        return None
    limit = spec.disable_by_batch_size
    num_seqs = config.max_num_seqs if not limit else min(config.max_num_seqs, limit - 1)
    return (num_seqs, spec.num_speculative_tokens) if num_seqs >= 1 else None


def max_sequence_tokens(config: EngineConfig, arch: ModelArchConfig, *, max_model_len: int) -> int:
    """The longest context one sequence can have in a step: what the plan pads gathers to.

    NOTE: the batched decode gathers every decode's blocks padded to the longest one
    (runtime/attention/sdpa.py), so one sequence at this length and max_num_seqs - 1 short ones
    already gather max_num_seqs x this length: the plan's decode step is the true worst case
    of that code, not an over-reservation. What bounds it besides max_model_len: a block table
    holds distinct pool blocks, so without windowed eviction (whose tables keep freed
    entries) a sequence never exceeds the pool, when the pool's size is given up front
    (``num_kv_blocks`` or ``kv_cache_memory``). A budget-sized pool is sized after the plan
    and must hold a max_model_len request anyway.
    """
    if config.kv_window is not None or len(set(arch.layer_types or ())) > 1:
        return max_model_len  # NOTE: a hybrid KV cache's sliding tables keep freed entries too
    num_blocks = config.num_kv_blocks
    if num_blocks is None and config.kv_cache_memory is not None:
        per_token = kv_bytes_per_token(
            num_layers=arch.num_hidden_layers,
            num_kv_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
            kv_cache_dtype=config.kv_cache_dtype,
            dtype=_DTYPES[config.dtype],
        )
        num_blocks = config.kv_cache_memory // (config.block_size * per_token)
    if num_blocks is None or num_blocks < 1:
        return max_model_len
    return min(max_model_len, num_blocks * config.block_size)


_GEMM_SCRATCH: dict[tuple[tuple[GemmShape, ...], str, int], int] = {}


def measure_kernel_scratch(
    config: EngineConfig, plan: ActivationPlan, b_operands: list[torch.Tensor] | None = None
) -> int | None:
    """GEMM library scratch for ``plan``'s GEMM shapes, measured once per process and shapes.

    Runs each shape once (``kernel_scratch.measure_gemm_scratch``; ``b_operands``: the
    model's weights as right operands, so nothing weight-sized is allocated) and keeps the
    figure: later engines with the same shapes and thread count get the same answer, while
    the library's buffers already sit in the process. 0 where it cannot be measured.
    NOTE: only with a memory budget (None otherwise): it is the only sizing it changes, and
    the GEMMs cost ~0.5 s of start-up on 2 cores (the logits GEMM dominates).
    """
    if config.memory_budget is None:
        return None
    device = config.device
    key = (plan.gemm_shapes, str(torch.device(device)), torch.get_num_threads())
    if key not in _GEMM_SCRATCH:
        got = measure_gemm_scratch(plan.gemm_shapes, device=device, b_operands=b_operands or [])
        _GEMM_SCRATCH[key] = got or 0
    return _GEMM_SCRATCH[key]


def plan_kv_blocks(
    config: EngineConfig,
    arch: ModelArchConfig,
    *,
    weights_bytes: int,
    kv_bytes_per_token: int,
    max_model_len: int,
    activation_bytes: int | None = None,
    activation_plan: ActivationPlan | None = None,
    device_free_bytes: int | None = None,
    kernel_scratch_bytes: int | None = None,
    packed_weights_bytes: int = 0,
    tracing_bytes: int = 0,
    kv_groups: tuple[KVGroupSpec, ...] | None = None,
) -> MemoryReport:
    """Decide the number of KV blocks from the options, in this order of precedence:

    ``num_kv_blocks`` > ``kv_cache_memory`` > ``memory_budget`` > a fraction of available
    memory. ``activation_bytes`` defaults to ``activation_plan.reserve_bytes``;
    ``kernel_scratch_bytes`` is the measured GEMM scratch (``measure_kernel_scratch``; None:
    not measured, counted as 0). ``packed_weights_bytes``: the part of ``weights_bytes`` held
    as prepacked kernel copies (reported, already counted in ``weights_bytes``).
    ``tracing_bytes``: what the activation plan's trace left resident (``measure_growth``),
    added to the headroom. ``kv_groups``: a hybrid KV cache's groups (``kv_bytes_per_token``
    is then per block id), counted per group in the one max-length request and the report.
    With a budget, raises MemoryBudgetError (saying how many bytes are missing) when the
    weights, activations, kernel scratch, headroom and one max-length request's KV (or the
    load-time double copy of the weights) do not fit, or when explicit KV sizes overflow it.
    """
    if activation_bytes is None:
        if activation_plan is None:
            raise ValueError("plan_kv_blocks needs activation_bytes or activation_plan")
        activation_bytes = activation_plan.reserve_bytes
    scratch_bytes = kernel_scratch_bytes or 0
    if (
        min(weights_bytes, activation_bytes, scratch_bytes, tracing_bytes) < 0
        or kv_bytes_per_token < 1
        or max_model_len < 1
    ):
        raise ValueError(
            f"invalid sizes: weights_bytes={weights_bytes}, activation_bytes={activation_bytes}, "
            f"kernel_scratch_bytes={kernel_scratch_bytes}, tracing_bytes={tracing_bytes}, "
            f"kv_bytes_per_token={kv_bytes_per_token}, max_model_len={max_model_len}"
        )
    block_bytes = config.block_size * kv_bytes_per_token
    budget = config.memory_budget
    # NOTE: on the CPU the host swap tier is the same RAM as the pool, so it is in the budget.
    host_in_budget = torch.device(config.device).type == "cpu"
    # What running a step takes beyond weights and KV (one figure in the messages below).
    step_bytes = activation_bytes + scratch_bytes
    headroom = HEADROOM_BYTES + tracing_bytes
    fixed = weights_bytes + step_bytes + headroom
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory is not None:
        num_blocks = config.kv_cache_memory // block_bytes
    elif budget is not None:
        free = budget - fixed
        num_shares = 1
        if host_in_budget and config.swap_space is not None:
            free -= config.swap_space // block_bytes * block_bytes
        elif host_in_budget and config.preemption_mode == "swap":
            num_shares = 2  # the pool and an equal host tier split what is left
        one = -(-max_model_len // config.block_size)
        if kv_groups:
            chunk = config.max_num_batched_tokens
            one = hybrid_blocks_per_request(kv_groups, config.block_size, max_model_len, chunk)
        need = one * block_bytes * num_shares
        _check_fits(
            budget,
            weights_bytes,
            step_bytes,
            max_model_len,
            need,
            free,
            packed_weights_bytes,
            headroom,
        )
        num_blocks = free // num_shares // block_bytes
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
        if num_host_blocks == 0 and config.swap_space > 0:
            # NOTE: vLLM's swap_space is in GiB, kvserve's in bytes: swap_space=4 meant as
            # GiB would otherwise give no host tier and swap would silently recompute.
            raise ValueError(
                f"swap_space={config.swap_space} bytes holds no KV block (one is {block_bytes} "
                "bytes); it is a byte count (suffixes accepted on the command line: 4GiB)"
            )
    elif config.preemption_mode == "swap":
        # NOTE: swap mode without a size gets a host tier as large as the device pool, so
        # every running request can be swapped out at least once.
        num_host_blocks = num_blocks
    else:
        num_host_blocks = 0
    report = MemoryReport(
        weights_bytes=weights_bytes,
        activation_bytes=activation_bytes,
        headroom_bytes=headroom,
        kv_bytes_per_token=kv_bytes_per_token,
        block_size=config.block_size,
        num_kv_blocks=num_blocks,
        num_host_blocks=num_host_blocks,
        max_model_len=max_model_len,
        budget_bytes=budget,
        activation_plan=activation_plan,
        kernel_scratch_bytes=kernel_scratch_bytes,
        packed_weights_bytes=packed_weights_bytes,
        tracing_bytes=tracing_bytes,
        kv_groups=kv_groups,
        max_chunk=config.max_num_batched_tokens if kv_groups else 1,
    )
    if budget is not None:
        total = fixed + report.kv_cache_bytes + (report.host_cache_bytes if host_in_budget else 0)
        if total > budget:
            raise MemoryBudgetError(
                f"memory_budget of {_fmt(budget)} is too small for the requested KV cache: "
                f"weights {weights_bytes} + activations and kernel scratch {step_bytes} + "
                f"headroom {headroom} + KV {report.kv_cache_bytes}"
                + (f" + host tier {report.host_cache_bytes}" if host_in_budget else "")
                + f" = {total} bytes; {total - budget} bytes ({(total - budget) / MiB:.1f} MiB) "
                "are missing"
            )
    return report


def _check_fits(
    budget: int,
    weights_bytes: int,
    step_bytes: int,
    max_model_len: int,
    need: int,
    free: int,
    packed_weights_bytes: int = 0,
    headroom_bytes: int = HEADROOM_BYTES,
) -> None:
    """Raise MemoryBudgetError unless ``need`` bytes of KV (one max-length request, and its
    host-tier twin in swap mode) fit in ``free``, and loading fits in the budget.
    ``step_bytes``: activations + kernel scratch.
    NOTE: the prepacked copies are made after the loader's state dict is freed, so the load
    peak holds the unpacked weights twice."""
    steady = weights_bytes + step_bytes + headroom_bytes + need
    load_peak = load_peak_bytes(weights_bytes - packed_weights_bytes)
    missing = max(need - free, load_peak - budget)
    if missing <= 0:
        return
    raise MemoryBudgetError(
        f"memory_budget of {_fmt(budget)} is too small: weights {weights_bytes} + activations "
        f"and kernel scratch {step_bytes} + headroom {headroom_bytes} + one "
        f"max_model_len={max_model_len} "
        f"request's KV ({need}) need {steady} bytes, and loading needs "
        f"{load_peak} (load headroom + the weights twice); "
        f"{missing} bytes ({missing / MiB:.1f} MiB) are missing. Raise --memory-budget or "
        "lower --max-model-len, --max-num-seqs or --max-num-batched-tokens"
    )


def load_peak_bytes(weights_bytes: int) -> int:
    """Peak process bytes while loading: load headroom + the loader's and the model's copy."""
    return LOAD_HEADROOM_BYTES + 2 * weights_bytes
