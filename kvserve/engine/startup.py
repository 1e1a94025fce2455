"""``LLMEngine`` start-up, as named phases. Each takes what the earlier ones produced.

Order (``LLMEngine.__init__`` runs them in this order; the order matters):

0. ``choose_kernels``: the dtype (for "auto") and each projection's kernel per M bucket
   (``kvserve.runtime.autotune.choose_kernels``), measured on the model's shapes (or read
   from the cache) before any weight is read; left to phase 1 when the weights load
   quantized (which shapes are is known once read).
1. ``load_engine_model``: weights -> model on its device and dtype with the chosen kernels,
   tokenizer, weight bytes (prepacked copies included); for a model loaded quantized, the
   dtype and kernels chosen on its quantized projections (``EngineModel.kernels``: the
   final choice).
2. ``resolve_max_model_len``: the context length served (config vs the model's).
3. ``plan_step_activations`` (``memory_budget``): the largest step's activation arena.
4. ``measure_gemm_scratch``: the GEMM library's own buffers for the planned steps' shapes.
   NOTE: before the KV pool exists; the weights serve as the GEMMs' right operands.
5. ``size_kv_pool``: the memory budget -> KV blocks and host blocks (``MemoryReport``).
6. ``build_runner``: the model runner with its pre-allocated KV cache.
7. ``build_kv_cache_manager``: ``KVCacheConfig`` -> ``create_kv_cache_manager`` (the map of
   manager variants in ``core/managers.py``).
8. ``build_scheduler``: the scheduler over that manager.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvserve.config import ModelArchConfig
from kvserve.core.kv.kv_cache_config import KVCacheConfig, KVWindow
from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.kv.kv_groups import KVGroupSpec, group_layers
from kvserve.core.kv.managers import create_kv_cache_manager
from kvserve.core.sched.measured_budget import MeasuredStepBudget
from kvserve.core.sched.scheduler import Scheduler
from kvserve.core.sched.speculate import Speculator
from kvserve.core.sched.step_budget import StepTimeBudget
from kvserve.engine.config import EngineConfig
from kvserve.engine.memory_budget import MemoryReport, measure_kernel_scratch, plan_kv_blocks
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import load_arch, load_model, resolve_model
from kvserve.models.quant_model import quantization_summary, quantized_nbytes, summary_line
from kvserve.models.quant_select import quantized_projections
from kvserve.runtime import autotune
from kvserve.runtime.attention import get_attention_backend
from kvserve.runtime.attention.layer_kinds import reads_step_metadata
from kvserve.runtime.autotune import KernelChoice, TuneSettings
from kvserve.runtime.linear import gather_into_huge_pages, warm_row_buckets
from kvserve.runtime.memory_plan.planner import ActivationPlan
from kvserve.runtime.model_runner import ModelRunner
from kvserve.runtime.native.chunk_limit import configure_backend
from kvserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvserve.distributed.executor import TensorParallelExecutor, TPRunner

logger = logging.getLogger("kvserve")


@dataclass(frozen=True)
class EngineModel:
    """What loading produced: the model (on its device, in eval mode) and its companions."""

    model: LlamaForCausalLM
    arch: ModelArchConfig
    tokenizer: Tokenizer
    path: str
    dtype: torch.dtype
    weights_bytes: int  # parameters + buffers + prepacked copies + quantized blocks, as held
    packed_weights_bytes: int  # prepacked weight copies held beside the parameters
    quantization: dict[str, Any]  # quantization_summary: mode and weight bytes by format
    # This process's shapes: the model's, or rank 0's heads under tensor parallelism.
    runner_arch: ModelArchConfig
    tp: TensorParallelExecutor | None  # the tensor-parallel executor when size > 1
    kernels: KernelChoice  # the dtype and kernels in force (phase 0's, or phase 1's)


def loads_quantized(config: EngineConfig) -> str:
    """The ``quantization`` the weights load with: the config's on a CPU in one process,
    else "none" (dense weights).

    NOTE: "auto" keeps a GGUF's quantized tensors quantized on the CPU (the int8-dot
    kernels); elsewhere it means dense weights (config rejects explicit formats there).
    Tensor parallelism shards dense weights (quantized ones would need block-aligned
    column slices), so it loads them dense.
    """
    on_cpu = torch.device(config.device).type == "cpu"
    return config.quantization if on_cpu and config.tensor_parallel_size == 1 else "none"


def tune_settings(config: EngineConfig) -> TuneSettings:
    """What kernel selection takes of the engine's options."""
    return TuneSettings(
        config.dtype, config.device, config.kernel_selection, config.batch_invariant
    )


def resolve_model_source(config: EngineConfig) -> EngineConfig:
    """Before phase 0: ``config`` with its model as a local path (None: the embedded GGUF; a
    Hugging Face Hub id: its snapshot in the Hugging Face cache, downloaded unless
    ``HF_HUB_OFFLINE`` is set). NOTE: resolved once, so the later phases and the
    tensor-parallel workers read local files and the Hub is asked once."""
    return config.replace(model=resolve_model(config.model))


def choose_kernels(config: EngineConfig) -> KernelChoice:
    """Phase 0: apply the torch settings; choose the dtype and the projection kernels, or
    leave them to phase 1 (the pending choice) when the model may hold quantized projections:
    which shapes it does is known once its weights are read."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    if loads_quantized(config) != "none":
        return autotune.choose_kernels(tune_settings(config))
    return autotune.choose_kernels(tune_settings(config), load_arch(config.model))


def load_engine_model(config: EngineConfig, kernels: KernelChoice) -> EngineModel:
    """Phase 1: load the weights and tokenizer, build the model with ``kernels``' plan and
    the attention backend ``config.attention_backend`` names (ValueError naming why where it
    cannot run on ``config.device``, before any weight is read)."""
    attn_backend = get_attention_backend(config.attention_backend, config.device)
    quantization = loads_quantized(config)
    loaded = load_model(config.model, dtype=kernels.dtype, quantization=quantization)
    tokenizer = Tokenizer.from_loaded(loaded.tokenizer_dir, loaded.gguf_file)
    tp = None
    runner_arch = loaded.arch
    if config.tensor_parallel_size > 1:
        from kvserve.distributed.executor import TensorParallelExecutor

        tp = TensorParallelExecutor.start(config, loaded.arch)
        model = tp.build_model(loaded.state_dict)
        runner_arch = tp.runner_arch()
        dtype = kernels.dtype
    else:
        model = LlamaForCausalLM(
            loaded.arch, attn_backend=attn_backend, max_model_len=config.max_model_len
        )
        model.load_weights(loaded.state_dict)
        if kernels.pending is not None:
            # NOTE: the quantized projections run their own kernels, which may favour the
            # other dtype under ``auto``: such a model loads in float32, cast once decided.
            asked = tune_settings(config.replace(dtype=kernels.pending))
            kernels = autotune.choose_kernels(asked, loaded.arch, quantized_projections(model))
        dtype = kernels.dtype
        model = model.to(device=config.device, dtype=dtype).eval()
    # NOTE: the selection holds the quantized projections' choices too (the int8-dot kernel
    # or a dense copy, per M), so its plan is the whole model's.
    model.set_linear_plan(kernels.plan)
    if tp is None:
        configure_backend(
            model.attn_backend,
            loaded.arch,
            dtype,
            config.max_num_batched_tokens,
            mode=config.kernel_selection,
            device=config.device,
            batch_invariant=config.batch_invariant,
        )
    # NOTE: a parameter that only a prepacked copy reads is freed (the copy rebuilds it when
    # needed), so such weights are held once; under tensor parallelism the workers keep theirs.
    freed = model.release_packed_weights() if tp is None else 0
    if torch.device(config.device).type == "cpu":
        in_huge = gather_into_huge_pages(model.linears())
        logger.debug("weights moved into huge pages: %.1f MiB", in_huge / (1 << 20))
    # NOTE: prepacked weight copies are held beside (or instead of) the parameters: counted
    # as weights.
    packed = sum(lin.extra_nbytes for lin in model.linears())
    logger.debug(
        "%s; prepacked weight copies %.1f MiB (counted as weights; %.1f MiB of parameters "
        "they replace freed)",
        kernels.summary(),
        packed / (1 << 20),
        freed / (1 << 20),
    )
    weights_bytes = (
        sum(p.numel() * p.element_size() for p in model.parameters())
        + sum(b.numel() * b.element_size() for b in model.buffers())
        + packed
        # NOTE: quantized weights count as held (blocks), so the KV pool gets the rest.
        + quantized_nbytes(model)
    )
    summary = quantization_summary(model, quantization)
    logger.debug(summary_line(summary))
    return EngineModel(
        model,
        loaded.arch,
        tokenizer,
        loaded.path,
        dtype,
        weights_bytes,
        packed,
        summary,
        runner_arch,
        tp,
        kernels,
    )


def resolve_max_model_len(config: EngineConfig, arch: ModelArchConfig) -> int:
    """Phase 2: ``config.max_model_len`` (default: the model's); ValueError past the model's."""
    if config.max_model_len is not None and config.max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds the model's context length "
            f"{arch.max_position_embeddings}"
        )
    return min(config.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)


def measure_gemm_scratch(
    config: EngineConfig, activation_plan: ActivationPlan | None, model: LlamaForCausalLM
) -> int | None:
    """Phase 4: the GEMM library's buffers for the planned steps (None: not measured).

    NOTE: before the KV pool exists; the weights serve as the GEMMs' right operands.
    """
    weights = [p.t() for p in model.parameters() if p.dim() == 2]
    return measure_kernel_scratch(config, activation_plan, weights)


def size_kv_pool(
    config: EngineConfig,
    loaded: EngineModel,
    *,
    kv_bytes_per_token: int,
    max_model_len: int,
    activation_plan: ActivationPlan | None,
    kernel_scratch_bytes: int | None,
    tracing_bytes: int = 0,
    kv_groups: tuple[KVGroupSpec, ...] | None = None,
    extra_activation_bytes: int = 0,
) -> MemoryReport:
    """Phase 5: the budget left after weights, activations, scratch and headroom -> blocks
    (per block id of a hybrid KV cache's ``kv_groups``).

    The activations are the largest step's plus, where decode steps will be captured as CUDA
    graphs (``captures_decode_graphs``), the graphs' own arena (``graph_reserve_bytes``),
    and ``extra_activation_bytes`` (a draft model's own arena, ``engine/draft_model.py``).
    """
    activation_bytes = None
    if activation_plan is not None:
        activation_bytes = (
            activation_plan.reserve_bytes
            + graph_reserve_bytes(config, loaded, activation_plan)
            + extra_activation_bytes
        )
    return plan_kv_blocks(
        config,
        loaded.arch,
        weights_bytes=loaded.weights_bytes,
        kv_bytes_per_token=kv_bytes_per_token,
        max_model_len=max_model_len,
        activation_bytes=activation_bytes,
        activation_plan=activation_plan,
        device_free_bytes=device_free_bytes(config.device),
        kernel_scratch_bytes=kernel_scratch_bytes,
        packed_weights_bytes=loaded.packed_weights_bytes,
        tracing_bytes=tracing_bytes,
        kv_groups=kv_groups,
    )


def captures_decode_graphs(config: EngineConfig, loaded: EngineModel) -> bool:
    """Whether the runner captures pure-decode steps as CUDA graphs (``runtime/cuda_graphs``):
    on CUDA, in one process, with the Triton attention backend, unless ``enforce_eager``;
    not for a model whose layers read the step's metadata each their own way (Gemma:
    ``layer_kinds.reads_step_metadata``), which derives it anew each step, nor with a hybrid
    KV cache (per-group tables)."""
    return (
        torch.device(config.device).type == "cuda"
        and not config.enforce_eager
        and loaded.tp is None
        and loaded.model.attn_backend.name == "triton"
        and reads_step_metadata(loaded.arch)
        and kv_groups_of(config, loaded.arch) is None
    )


def kv_groups_of(config: EngineConfig, arch: ModelArchConfig) -> tuple[KVGroupSpec, ...] | None:
    """The KV cache groups of a model whose layers mix full and sliding attention (the
    hybrid KV cache, ``core/kv/hybrid.py``), else None. ValueError naming an option the
    hybrid cache does not take."""
    # NOTE: Gemma keeps layer_types where no window applies (its sliding layers' own RoPE).
    if arch.sliding_window is None or len(set(arch.layer_types or ())) < 2:
        return None
    what = "a model whose layers mix full and sliding attention (the hybrid KV cache)"
    if config.kv_window is not None:
        raise ValueError(f"kv_window (windowed eviction) is not supported with {what}")
    if config.kv_allocator != "paged":
        raise ValueError(f"kv_allocator={config.kv_allocator!r} is not supported with {what}")
    if config.enable_host_prefix_cache:
        raise ValueError(f"enable_host_prefix_cache is not supported with {what}")
    if config.tensor_parallel_size > 1:
        raise ValueError(f"tensor_parallel_size > 1 is not supported with {what}")
    if config.speculative_config is not None:
        # NOTE: the hybrid manager has no rollback of rejected draft slots (release_rejected).
        raise ValueError(f"speculative_config is not supported with {what}")
    return group_layers(arch.layer_types or (), arch.sliding_window)


def graph_reserve_bytes(
    config: EngineConfig, loaded: EngineModel, activation_plan: ActivationPlan
) -> int:
    """Bytes the decode graphs hold besides the eager steps' activations (0 without graphs).

    NOTE: they run on their own activation buffers (an eager step must never free memory a
    graph replays into), sized by the largest bucket: a decode step of ``max_num_seqs``
    rows, whose planned peak the activation plan traced (``peaks_by_step["decode"]``).
    """
    if not captures_decode_graphs(config, loaded):
        return 0
    return activation_plan.peaks_by_step.get("decode", activation_plan.reserve_bytes)


def build_runner(
    config: EngineConfig,
    loaded: EngineModel,
    report: MemoryReport,
    max_model_len: int | None = None,
) -> tuple[ModelRunner | TPRunner, MemoryReport]:
    """Phase 6: the model runner; it allocates the KV cache of ``report``'s size once.

    On CUDA with the Triton attention backend, unless ``config.enforce_eager``, it captures
    the pure-decode steps as CUDA graphs per batch-size bucket (``runtime/cuda_graphs.py``,
    ``max_model_len`` wide block tables).

    Under tensor parallelism every rank builds its runner over its own heads and the driver
    steps them through a ``TPRunner``; the report becomes the per-rank one.
    """
    runner_kwargs: dict[str, Any] = dict(
        num_blocks=report.num_kv_blocks,
        block_size=config.block_size,
        num_host_blocks=report.num_host_blocks,
        device=config.device,
        dtype=loaded.dtype,
        seed=config.seed,
        kv_cache_dtype=config.kv_cache_dtype,
        kv_window=config.kv_window,
        kv_sink_tokens=config.kv_sink_tokens,
        kv_groups=report.kv_groups,
    )
    runner = ModelRunner(loaded.model, loaded.runner_arch, **runner_kwargs)
    if loaded.tp is None:
        warm_kernel_primitives(config, runner)
        if captures_decode_graphs(config, loaded):
            runner.capture_decode_graphs(
                config.max_num_seqs, max_model_len or loaded.arch.max_position_embeddings
            )
        return runner, report
    from kvserve.distributed.executor import TPRunner

    loaded.tp.start_runners(runner, runner_kwargs)
    return TPRunner(loaded.tp), loaded.tp.memory_report(report)


def warm_kernel_primitives(config: EngineConfig, runner: ModelRunner) -> None:
    """Phase 6b: build the GEMM library's per-shape primitives for every row bucket a step
    can use (``kvserve.runtime.linear.warm_row_buckets``), so RSS stays flat while serving.

    Layer projections see up to ``max_num_batched_tokens`` rows, the lm_head up to
    ``max_num_seqs`` (one per sampling request; prompt logprobs may build more lazily).
    """
    model = runner.model
    linears = getattr(model, "linears", None)
    if linears is None:
        return
    t0 = time.perf_counter()
    built = linears()
    rows = [config.max_num_batched_tokens] * (len(built) - 1) + [config.max_num_seqs]
    calls = warm_row_buckets(list(zip(built, rows, strict=True)), runner.dtype, runner.device)
    if calls:
        logger.debug(
            "kernel primitives: %d row-bucket shapes built in %.2f s",
            calls,
            time.perf_counter() - t0,
        )


def kv_cache_config(
    config: EngineConfig, report: MemoryReport, max_model_len: int
) -> KVCacheConfig:
    """The KV cache manager's configuration: the engine's options on the sized pool."""
    window = None
    if config.kv_window is not None:
        window = KVWindow(config.kv_window, config.kv_sink_tokens)
    return KVCacheConfig(
        num_blocks=report.num_kv_blocks,
        block_size=config.block_size,
        allocator=config.kv_allocator,
        enable_prefix_caching=config.enable_prefix_caching,
        enable_host_prefix_cache=config.enable_host_prefix_cache,
        num_host_blocks=report.num_host_blocks,
        kv_window=window,
        max_model_len=max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_groups=report.kv_groups,
    )


def build_kv_cache_manager(
    config: EngineConfig, report: MemoryReport, max_model_len: int
) -> KVCacheManager:
    """Phase 7: the manager variant ``create_kv_cache_manager`` picks for this config."""
    return create_kv_cache_manager(kv_cache_config(config, report, max_model_len))


def build_scheduler(
    config: EngineConfig, max_model_len: int, kv_cache_manager: KVCacheManager
) -> Scheduler:
    """Phase 8: the scheduler over the manager (with the step-time budget unless it is off)."""
    step_budget: StepTimeBudget | None = None
    if config.step_budget is None:  # neither flag: the budget where its own fit holds
        step_budget = MeasuredStepBudget(config.step_budget_config())
    elif config.step_budget:
        step_budget = StepTimeBudget(config.step_budget_config())
    spec = config.speculative_config
    return Scheduler(
        config.scheduler_config(max_model_len),
        kv_cache_manager,
        step_budget=step_budget,
        speculator=Speculator(spec, max_model_len) if spec is not None else None,
    )


def device_free_bytes(device: str) -> int | None:
    """Free accelerator memory on ``device`` (None on the CPU: the budget decides)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return free
    return None


# The request length the start-up line counts concurrent requests at (or max_model_len).
SUMMARY_REQUEST_LEN = 2048


def startup_line(engine: Any) -> str:  # LLMEngine
    """The one start-up line logged at INFO: the model as run, dtype and kernels, the KV
    pool's capacity and the start-up time. The full memory report is logged at DEBUG
    (``MemoryReport.lines``) and kept in ``LLMEngine.memory_report`` and ``stats()``.

    e.g. ``SmolLM2-135M-Instruct.Q4_1 | bfloat16, int8-dot kernels (avx2), kernel choice
    from cache | KV 36,448 tokens in 2,278 blocks, 17 requests at 2,048 tokens | ready in
    3.1 s``.
    """
    from kvserve.models.quant_model import model_id

    quant = engine.quantization or {}
    held = set(quant.get("weight_bytes_by_format", {})) - {"dense"}
    if held and quant.get("kernels"):
        kernels = f"int8-dot kernels ({quant['kernels']})"
    elif held:
        kernels = "dequantizing kernels"
    else:
        kernels = "dense kernels"
    source = getattr(getattr(engine.kernels, "selection", None), "source", None)
    how = {"off": "selection off", "cache": "choice from cache"}.get(source, "choice measured")
    rep = engine.memory_report
    typical = min(SUMMARY_REQUEST_LEN, engine.max_model_len)
    return (
        f"{model_id(engine.model_path, quant)} | {engine.kernels.dtype_name}, {kernels}, "
        f"{how} | KV {rep.max_tokens_in_cache:,} tokens in {rep.num_kv_blocks:,} blocks, "
        f"{rep.max_concurrent_requests(typical):,} requests at {typical:,} tokens"
        f"{_draft_part(engine.config.speculative_config)}"
        f" | ready in {engine.startup_seconds:.1f} s"
    )


def _draft_part(spec: Any) -> str:
    """The start-up line's speculative draft model (its KV is in the blocks counted)."""
    if spec is None or spec.model is None:
        return ""
    name = spec.model.rstrip("/").rsplit("/", 1)[-1]
    return f" | draft {name}, k {spec.num_speculative_tokens}, cost {spec.draft_token_cost}"
