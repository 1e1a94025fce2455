"""The activation plan of the worst-case steps: trace each, pack its lifetimes, keep the largest.

``worst_case_steps`` builds the largest steps the scheduler can issue under its limits,
``trace_step`` records one of them (``recorder.LifetimeRecorder``) and ``plan_activations``
packs each (``arena.pack_intervals``) and returns the plan of the most demanding one
(``ActivationPlan``); ``describe`` words it for the logs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from kvserve.config import ModelArchConfig
from kvserve.core.outputs import ScheduledRequest, SchedulerOutput
from kvserve.runtime.attention.native_cpu import NativeCPUBackend
from kvserve.runtime.kernel_scratch import GemmShape
from kvserve.runtime.memory_plan.arena import (
    ARENA_ALIGNMENT,
    ArenaPlan,
    live_bytes_lower_bound,
    pack_intervals,
)
from kvserve.runtime.memory_plan.disk_cache import cached_on_disk, plan_key
from kvserve.runtime.memory_plan.recorder import LifetimeRecorder
from kvserve.runtime.native.chunk_limit import ChunkAttention
from kvserve.sampling_params import MAX_LOGPROBS, SamplingParams

# ------------------------------------------------------------------------------ step shapes
# NOTE: the sampler's heaviest path: penalties (a clone of the logits), min_tokens masks,
# min-p, a top-p that a flat distribution can only meet by sorting the whole vocabulary, a
# seeded generator and the most logprobs a request may ask for.
WORST_CASE_SAMPLING = SamplingParams(
    temperature=1.0,
    top_p=0.99,
    min_p=0.001,
    repetition_penalty=1.1,
    presence_penalty=0.5,
    frequency_penalty=0.5,
    min_tokens=2,
    max_tokens=None,
    logprobs=MAX_LOGPROBS,
    seed=0,
)


def worst_case_steps(
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    speculative: tuple[int, int] | None = None,
) -> dict[str, SchedulerOutput]:
    """The largest steps the scheduler may issue under these limits, by name.

    - ``prefill``: one chunk of the whole token budget at the end of a max-length context
      (it gathers that context and builds a [chunk, context] mask);
    - ``decode``: as many decodes as the limits allow, each at max_model_len (each decode
      group gathers its sequences' blocks, padded to its longest; equal lengths make one
      group). NOTE: the true worst case, not an over-reservation; what tightens it is a
      smaller ``max_model_len``, which ``memory_budget.max_sequence_tokens`` bounds by the
      pool's size when that is fixed;
    - ``mixed``: decodes for all sequences but one, plus a chunk of the remaining budget;
    - ``speculate`` (with ``speculative`` = (the most requests that speculate in one step,
      draft tokens each)): that many decodes of ``1 + k`` tokens, every one a sampling row
      (the logits and the sampler's copies of them grow with the rows, not the tokens).
    Every sequence samples. Block ids repeat freely: only shapes matter to the plan.
    """
    for name, value in (
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("max_num_seqs", max_num_seqs),
        ("max_model_len", max_model_len),
        ("block_size", block_size),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    table = list(range(-(-max_model_len // block_size)))

    def req(rid: str, num_tokens: int, num_drafts: int = 0) -> ScheduledRequest:
        return ScheduledRequest(
            request_id=rid,
            token_ids=[0] * num_tokens,
            start_pos=max_model_len - num_tokens,
            block_ids=table,
            sample=True,
            sampling_params=WORST_CASE_SAMPLING,
            prompt_token_ids=[0, 1, 2, 3],
            output_token_ids=[4],
            seed=0,
            spec_token_ids=[0] * num_drafts,
        )

    chunk = min(max_num_batched_tokens, max_model_len)
    num_decodes = min(max_num_seqs, max_num_batched_tokens)
    steps = {
        "prefill": SchedulerOutput([req("prefill", chunk)]),
        "decode": SchedulerOutput([req(f"decode-{i}", 1) for i in range(num_decodes)]),
    }
    rest = min(max_num_batched_tokens - (max_num_seqs - 1), max_model_len)
    if max_num_seqs > 1 and rest > 1:
        decodes = [req(f"decode-{i}", 1) for i in range(max_num_seqs - 1)]
        steps["mixed"] = SchedulerOutput([*decodes, req("chunk", rest)])
    if speculative is not None:
        num_seqs, k = speculative
        k = min(k, max_num_batched_tokens - 1, max_model_len - 1)
        num_seqs = min(num_seqs, max_num_seqs, max_num_batched_tokens // (1 + k))
        if k >= 1 and num_seqs >= 1:
            drafting = [req(f"spec-{i}", 1 + k, k) for i in range(num_seqs)]
            steps["speculate"] = SchedulerOutput(drafting)
    return steps


# ------------------------------------------------------------------------------- the planner
@dataclass(frozen=True)
class ActivationPlan:
    """The activation plan of the most demanding step (the one with the largest arena)."""

    step_name: str
    num_tokens: int
    num_seqs: int
    num_tensors: int
    arena: ArenaPlan
    eager_peak_bytes: int  # most bytes live at once as eager PyTorch frees them
    num_layers_traced: int
    peaks_by_step: dict[str, int] = field(default_factory=dict)  # planned peak of each step
    # Modelled kernel scratch (kernel_scratch.py), already inside the arena and eager peak:
    # the largest buffer one op's kernel takes for itself in this step.
    kernel_scratch_bytes: int = 0
    num_threads: int = 1  # the scratch is per thread
    # Every GEMM shape of every candidate step, for measure_gemm_scratch at start-up.
    gemm_shapes: tuple[GemmShape, ...] = ()

    @property
    def planned_peak_bytes(self) -> int:
        return self.arena.peak_bytes

    @property
    def naive_bytes(self) -> int:
        return self.arena.naive_bytes

    @property
    def lower_bound_bytes(self) -> int:
        return self.arena.lower_bound_bytes

    @property
    def reserve_bytes(self) -> int:
        """Bytes to set aside for activations: the arena, or eager PyTorch's peak if higher.

        NOTE: the runner executes eagerly (PyTorch frees a tensor when its last Python
        reference goes, not at its last use), so its live peak can exceed the arena.
        """
        return max(self.arena.peak_bytes, self.eager_peak_bytes)


def trace_step(
    model: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    sched: SchedulerOutput,
    *,
    block_size: int,
    num_blocks: int,
    vocab_size: int,
    fake_mode: torch._subclasses.fake_tensor.FakeTensorMode | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
    num_threads: int | None = None,
) -> LifetimeRecorder:
    """Record one runner step: input batch, forward, logits of the sampling rows, sampler.

    ``model`` and ``kv_caches`` may be fake tensors of ``fake_mode`` (the forward then runs
    under it). The sampler always runs on real ``[num_sampling_rows, vocab]`` CPU logits: it
    reads values (``.tolist()``), which fake tensors cannot give. ``num_threads`` sizes the
    per-thread kernel scratch (None: torch's current thread count).
    """
    from contextlib import nullcontext

    from kvserve.runtime.input_batch import build_input_batch
    from kvserve.runtime.sampler import Sampler

    recorder = LifetimeRecorder(num_threads)
    fake_ctx = fake_mode if fake_mode is not None else nullcontext()
    with fake_ctx, recorder, torch.inference_mode():
        batch = build_input_batch(
            sched,
            block_size=block_size,
            num_blocks=num_blocks,
            device=torch.device(device),
            dtype=dtype,
            sliding_window=sliding_window,
        )
        hidden = model(batch.input_ids, batch.positions, kv_caches, batch.attn_meta)  # [T, H]
        logits = model.compute_logits(hidden.index_select(0, batch.logits_indices))  # [N, V]
        shape, logits_dtype = tuple(logits.shape), logits.dtype
        # NOTE: the real logits below continue this tensor's life: drop the fake one first.
        del logits
    if batch.sample_requests:
        with recorder, torch.inference_mode():
            real_logits = torch.zeros(shape, dtype=logits_dtype)  # [N, V]; flat distribution
            Sampler(vocab_size, seed=0).sample(real_logits, batch.sample_requests)
            del real_logits
    del hidden, batch
    return recorder


def plan_activations(
    arch: ModelArchConfig,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    attn_backend: str = "auto",
    steps: Sequence[str] | None = None,
    alignment: int = ARENA_ALIGNMENT,
    max_layers: int | None = None,
    num_threads: int | None = None,
    model_factory: Callable[..., torch.nn.Module],
    chunk_attention: ChunkAttention | None = None,
    speculative: tuple[int, int] | None = None,
) -> ActivationPlan:
    """Trace the worst-case steps (see ``worst_case_steps``) and plan the most demanding one.

    ``model_factory(arch, dtype=, device=, attn_backend=)`` builds the model to trace
    (``kvserve.models.llama.LlamaForCausalLM``; passed in so runtime/ imports no model).

    Nothing of the model's size is allocated: weights and KV cache are fake tensors.
    ``max_layers`` traces only that many decoder layers (None: all); ``steps`` restricts the
    candidates by name; ``num_threads`` sizes per-thread kernel scratch (None: torch's
    current count). ``chunk_attention``: the native backend's chunk choice, as the engine
    applies it (chunks through the decode kernel hold no gathered copy; chunks through
    float32 SDPA hold float32 copies). ``speculative``: (requests that speculate in one
    step at most, draft tokens each), as ``worst_case_steps`` takes it. Results are cached
    per argument set: in the process (engines built with the same options trace once) and on
    disk (``disk_cache``: a warm start traces nothing).
    """
    if max_layers is not None:
        if max_layers < 1:
            raise ValueError(f"max_layers must be >= 1 or None, got {max_layers}")
        arch = arch.with_num_layers(min(arch.num_hidden_layers, max_layers))
    args = (
        arch,
        max_num_batched_tokens,
        max_num_seqs,
        max_model_len,
        block_size,
        dtype,
        str(torch.device(device).type),
        attn_backend,
        tuple(steps) if steps is not None else None,
        alignment,
        num_threads if num_threads is not None else torch.get_num_threads(),
        model_factory,
        chunk_attention,
        speculative,
    )
    return cached_on_disk(plan_key(args), lambda: _plan_cached(*args))


@lru_cache(maxsize=16)
def _plan_cached(
    arch: ModelArchConfig,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    attn_backend: str,
    steps: tuple[str, ...] | None,
    alignment: int,
    num_threads: int,
    model_factory: Callable[..., torch.nn.Module],
    chunk_attention: ChunkAttention | None,
    speculative: tuple[int, int] | None = None,
) -> ActivationPlan:
    from torch._subclasses.fake_tensor import FakeTensorMode

    candidates = worst_case_steps(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        block_size=block_size,
        speculative=speculative,
    )
    if steps is not None:
        unknown = sorted(set(steps) - set(candidates))
        if unknown:
            raise ValueError(f"unknown steps {unknown}; choose from {sorted(candidates)}")
        candidates = {k: v for k, v in candidates.items() if k in steps}
    num_blocks = -(-max_model_len // block_size)
    fake_mode = FakeTensorMode()
    with fake_mode:
        model = model_factory(arch, dtype=dtype, device=device, attn_backend=attn_backend)
        backend = getattr(model, "attn_backend", None)
        if chunk_attention is not None and isinstance(backend, NativeCPUBackend):
            chunk_attention.apply(backend)
        kv_caches = [
            torch.empty(
                2,
                num_blocks,
                block_size,
                arch.num_key_value_heads,
                arch.head_dim,
                dtype=dtype,
                device=device,
            )  # [2, num_blocks, block_size, kvh, d]
            for _ in range(arch.num_hidden_layers)
        ]
    best: ActivationPlan | None = None
    peaks: dict[str, int] = {}
    gemm_shapes: set[GemmShape] = set()
    for name, sched in candidates.items():
        rec = trace_step(
            model,
            kv_caches,
            sched,
            block_size=block_size,
            num_blocks=num_blocks,
            vocab_size=arch.vocab_size,
            fake_mode=fake_mode,
            device=device,
            dtype=dtype,
            sliding_window=arch.shared_window,
            num_threads=num_threads,
        )
        gemm_shapes |= rec.gemm_shapes
        arena = pack_intervals(rec.intervals(), alignment)
        eager = live_bytes_lower_bound(rec.intervals(eager=True), alignment)
        peaks[name] = arena.peak_bytes
        plan = ActivationPlan(
            step_name=name,
            num_tokens=sched.total_num_scheduled_tokens,
            num_seqs=len(sched.scheduled),
            num_tensors=len(arena.intervals),
            arena=arena,
            eager_peak_bytes=eager,
            num_layers_traced=arch.num_hidden_layers,
            kernel_scratch_bytes=rec.scratch_bytes,
            num_threads=num_threads,
        )
        if best is None or plan.reserve_bytes > best.reserve_bytes:
            best = plan
    assert best is not None
    return dataclasses.replace(best, peaks_by_step=peaks, gemm_shapes=tuple(sorted(gemm_shapes)))


def describe(plan: ActivationPlan) -> list[str]:
    """One line per figure (bytes), for start-up logs and ``kvserve bench memory``."""
    return [
        f"planned activation peak: {plan.planned_peak_bytes} bytes",
        f"naive activation sum: {plan.naive_bytes} bytes",
        f"activation lower bound: {plan.lower_bound_bytes} bytes",
        f"eager activation peak: {plan.eager_peak_bytes} bytes",
        f"kernel scratch in the plan (attention kernels, {plan.num_threads} threads): "
        f"{plan.kernel_scratch_bytes} bytes",
        f"largest step: {plan.step_name} ({plan.num_tokens} tokens, {plan.num_seqs} seqs, "
        f"{plan.num_tensors} tensors, {plan.num_layers_traced} layers traced)",
    ]


__all__ = [
    "ActivationPlan",
    "WORST_CASE_SAMPLING",
    "describe",
    "plan_activations",
    "trace_step",
    "worst_case_steps",
]
