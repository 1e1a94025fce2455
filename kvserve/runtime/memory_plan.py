"""Static activation planning: trace one step, take every tensor's lifetime, pack one arena.

Seed ("Activation and Workspace Memory"): knowing every tensor's lifetime, assign offsets in
a pre-allocated arena so that tensors whose lifetimes do not overlap reuse the same bytes.

1. **Trace.** ``trace_step`` runs one runner step (input batch -> forward -> logits ->
   sampler) under a ``TorchDispatchMode`` that records every aten op's new output buffers
   with their size, the op that produced them, the last op that read them (any view or
   in-place alias counts as a use of its base) and the op at which eager PyTorch freed them.
   The forward runs on fake tensors (``FakeTensorMode``), so planning a 2048-token step of a
   model allocates nothing; the fake tensors keep the real device, so composite ops decompose
   exactly as in eager (e.g. CPU SDPA -> the flash kernel, not the math path).
   NOTE: the paged-attention code is plain eager PyTorch with Python control flow over the
   step's sequences, which torch.fx cannot trace; a dispatch mode sees the ops it issues.
   Op-internal workspace (a kernel's scratch) is invisible to it, so the recorder adds what
   ``kernel_scratch.py`` models (the per-thread buffers of CPU flash attention, of the
   native decode kernel and of the AMX prefill kernel) as a buffer live at that op only, and
   collects the step's GEMM shapes, whose library buffers the engine measures at start-up
   (``kernel_scratch.measure_gemm_scratch``). The native kernels are custom ops with fake
   kernels (``kvserve.runtime.native``), so the trace sees them as one op each.
2. **Pack.** ``pack_intervals``: greedy by size (largest first) with best-fit offsets, the
   "greedy by size" strategy of TFLite's arena planner (Pisarchyk & Lee, 2020).
3. **Report** (``ArenaPlan``): planned peak (arena size), naive sum (one buffer per tensor,
   no reuse) and the lower bound (most bytes live at one op, which no packing can beat).

``worst_case_steps`` builds the largest steps the scheduler can issue under its limits and
``plan_activations`` returns the plan of the most demanding one.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from kvserve.config import ModelArchConfig
from kvserve.core.outputs import ScheduledRequest, SchedulerOutput
from kvserve.runtime.attention.native_cpu import NativeCPUBackend
from kvserve.runtime.kernel_scratch import (
    GemmShape,
    amx_prefill_scratch_bytes,
    gemm_shape,
    native_decode_scratch_bytes,
    sdpa_cpu_flash_scratch_bytes,
)
from kvserve.runtime.native.chunk_limit import ChunkAttention
from kvserve.sampling_params import MAX_LOGPROBS, SamplingParams

ARENA_ALIGNMENT = 64  # bytes; every offset and size in a plan is a multiple of it


# ---------------------------------------------------------------------------------- packing
@dataclass(frozen=True, slots=True)
class Interval:
    """One buffer: live from op ``start`` to op ``end`` (both inclusive), ``size`` bytes."""

    start: int
    end: int
    size: int
    label: str = ""


def _align(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


def _check_intervals(intervals: Sequence[Interval], alignment: int) -> None:
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    for i, iv in enumerate(intervals):
        if iv.start < 0 or iv.end < iv.start or iv.size < 0:
            raise ValueError(
                f"interval {i} ({iv.label or 'unnamed'}) is invalid: start={iv.start}, "
                f"end={iv.end}, size={iv.size} (need 0 <= start <= end and size >= 0)"
            )


def live_bytes_lower_bound(intervals: Sequence[Interval], alignment: int = 1) -> int:
    """Most (aligned) bytes live at any one op: no arena for these lifetimes can be smaller."""
    _check_intervals(intervals, alignment)
    events: list[tuple[int, int]] = []
    for iv in intervals:
        size = _align(iv.size, alignment)
        events.append((iv.start, size))
        events.append((iv.end + 1, -size))
    # NOTE: at equal times frees sort first: an interval ending at op t and one starting at
    # op t + 1 are never live together.
    events.sort()
    live = best = 0
    for _, delta in events:
        live += delta
        best = max(best, live)
    return best


@dataclass(frozen=True)
class ArenaPlan:
    """Arena offsets for a set of lifetimes, with the figures that judge the packing."""

    intervals: tuple[Interval, ...]
    offsets: tuple[int, ...]  # offsets[i] is where intervals[i] lives in the arena
    alignment: int
    peak_bytes: int  # arena size: max(offset + aligned size)
    naive_bytes: int  # sum of aligned sizes: every tensor its own buffer
    lower_bound_bytes: int  # max aligned bytes live at one op

    def check(self) -> None:
        """Raise AssertionError naming the first broken invariant of the plan."""
        a = self.alignment
        assert len(self.offsets) == len(self.intervals), "one offset per interval"
        order = sorted(range(len(self.intervals)), key=lambda i: self.intervals[i].start)
        active: list[int] = []
        for i in order:
            iv, off = self.intervals[i], self.offsets[i]
            size = _align(iv.size, a)
            assert off % a == 0, f"interval {i}: offset {off} not aligned to {a}"
            assert off + size <= self.peak_bytes, f"interval {i} ends past the arena"
            active = [j for j in active if self.intervals[j].end >= iv.start]
            for j in active:
                other, o_off = self.intervals[j], self.offsets[j]
                o_size = _align(other.size, a)
                if size and o_size:
                    assert off + size <= o_off or o_off + o_size <= off, (
                        f"intervals {j} [{other.start}, {other.end}] @ {o_off}+{o_size} and "
                        f"{i} [{iv.start}, {iv.end}] @ {off}+{size} overlap in time and memory"
                    )
            active.append(i)
        assert self.lower_bound_bytes <= self.peak_bytes <= self.naive_bytes, (
            f"peak {self.peak_bytes} outside [lower bound {self.lower_bound_bytes}, "
            f"naive {self.naive_bytes}]"
        )


def pack_intervals(intervals: Sequence[Interval], alignment: int = ARENA_ALIGNMENT) -> ArenaPlan:
    """Place every interval at an arena offset; intervals live at the same op never overlap.

    Greedy by size: the largest buffers are placed first (ties: earlier start, then longer
    life), each at the smallest gap between the already-placed buffers that are live at the
    same time and that fits it (best fit), or on top of them when no gap fits.
    Every placement ends at most at the sum of the sizes placed so far, so the peak is
    never above the naive sum; it is never below the lower bound.
    """
    _check_intervals(intervals, alignment)
    n = len(intervals)
    sizes = [_align(iv.size, alignment) for iv in intervals]
    order = sorted(
        range(n),
        key=lambda i: (-sizes[i], intervals[i].start, -(intervals[i].end - intervals[i].start)),
    )
    starts = np.empty(n, dtype=np.int64)
    ends = np.empty(n, dtype=np.int64)
    placed_off = np.empty(n, dtype=np.int64)
    placed_size = np.empty(n, dtype=np.int64)
    offsets = [0] * n
    num_placed = 0
    for i in order:
        iv, size = intervals[i], sizes[i]
        k = num_placed
        live = (starts[:k] <= iv.end) & (ends[:k] >= iv.start)  # overlapping lifetimes
        offset = _best_fit(placed_off[:k][live], placed_size[:k][live], size)
        offsets[i] = offset
        starts[k], ends[k], placed_off[k], placed_size[k] = iv.start, iv.end, offset, size
        num_placed += 1
    peak = max((o + s for o, s in zip(offsets, sizes, strict=True)), default=0)
    return ArenaPlan(
        intervals=tuple(intervals),
        offsets=tuple(offsets),
        alignment=alignment,
        peak_bytes=peak,
        naive_bytes=sum(sizes),
        lower_bound_bytes=live_bytes_lower_bound(intervals, alignment),
    )


def _best_fit(offsets: np.ndarray, sizes: np.ndarray, size: int) -> int:
    """Lowest-waste gap of at least ``size`` bytes among the occupied ranges, else the top."""
    if size == 0 or offsets.size == 0:
        return 0
    order = np.argsort(offsets, kind="stable")
    best_offset, best_waste = -1, math.inf
    top = 0  # end of the occupied region below the current range
    for off, sz in zip(offsets[order].tolist(), sizes[order].tolist(), strict=True):
        gap = off - top
        if gap >= size and gap - size < best_waste:
            best_offset, best_waste = top, gap - size
        top = max(top, off + sz)
    return best_offset if best_offset >= 0 else top


# ---------------------------------------------------------------------------------- tracing
@dataclass(slots=True)
class _Buffer:
    size: int
    first: int  # op that allocated it
    last: int  # last op that used it (through any alias)
    label: str
    num_live_tensors: int = 0  # Python tensors (the base and its views) still alive
    freed: int | None = None  # op counter when eager PyTorch dropped the last of them


class LifetimeRecorder(TorchDispatchMode):
    """Records each aten op's new output buffers with their sizes and lifetimes.

    Composite ops are decomposed (inside this mode) so that the buffers their parts
    allocate are seen, as eager execution allocates them. Tensors that exist before the
    recording (weights, the KV cache) are not buffers of the step; writing into them or
    viewing them allocates nothing. Kernel scratch that ``kernel_scratch.py`` models is
    added as a buffer of its op (``scratch_bytes``: the largest); GEMM shapes are collected
    in ``gemm_shapes``.
    """

    def __init__(self, num_threads: int | None = None) -> None:
        super().__init__()
        self.num_ops = 0
        self.buffers: list[_Buffer] = []
        self.num_threads = num_threads if num_threads is not None else torch.get_num_threads()
        self.scratch_bytes = 0
        self.gemm_shapes: set[GemmShape] = set()
        self._buffer_of: dict[int, int] = {}  # id(tensor) -> index in self.buffers
        self._refs: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func.namespace not in ("aten", "kvserve"):  # prim.device and friends
            return func(*args, **kwargs)
        # NOTE: kvserve's native ops only write into their arguments: they are uses of the
        # buffers they touch (and may hold kernel scratch), never new buffers.
        if func.namespace == "aten" and func not in _NEW_BUFFER_OPS:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        step = self.num_ops
        self.num_ops += 1
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and (b := self._buffer_of.get(id(t))) is not None:
                self.buffers[b].last = step
        out = func(*args, **kwargs)
        self._record_outputs(func, args, kwargs, out, step)
        self._record_kernel(func, args, kwargs, step)
        return out

    def _record_kernel(self, func, args, kwargs, step: int) -> None:  # type: ignore[no-untyped-def]
        """Note what the op's kernel uses beyond its outputs (see kernel_scratch.py)."""
        if func in _GEMM_OPS:
            a, b = (args[1], args[2]) if func in _ADDMM_OPS else (args[0], args[1])
            shape = gemm_shape(a, b)
            if shape is not None:
                self.gemm_shapes.add(shape)
        elif func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            q, k = args[:2]
            is_causal = bool(args[4] if len(args) > 4 else kwargs.get("is_causal", False))
            size = sdpa_cpu_flash_scratch_bytes(
                q.shape, k.shape, q.dtype, self.num_threads, is_causal=is_causal
            )
            self._add_scratch(size, step, "kernel scratch: cpu flash attention")
        elif func._schema.name == "kvserve::paged_decode_attention":
            q, kv_cache, block_tables = args[1], args[2], args[3]
            max_context = block_tables.shape[1] * kv_cache.shape[2]
            size = native_decode_scratch_bytes(
                q.shape[1], max_context, q.shape[2], self.num_threads, block_tables.shape[1]
            )
            self._add_scratch(size, step, "kernel scratch: native decode attention")
        elif func._schema.name == "kvserve::amx_prefill_attention":
            q, kv_cache, ctx_len = args[1], args[2], args[4]
            size = amx_prefill_scratch_bytes(
                kv_cache.shape[3], ctx_len + q.shape[0], self.num_threads
            )
            self._add_scratch(size, step, "kernel scratch: AMX prefill attention")

    def _add_scratch(self, size: int, step: int, label: str) -> None:
        """A kernel's own buffer, live at its op only."""
        self.buffers.append(_Buffer(size, step, step, label, freed=step))
        self.scratch_bytes = max(self.scratch_bytes, size)

    def _record_outputs(self, func, args, kwargs, out, step: int) -> None:  # type: ignore[no-untyped-def]
        returns = func._schema.returns
        if not returns:
            return
        values = [out] if len(returns) == 1 else list(out)
        for ret, value in zip(returns, values, strict=True):
            tensors = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
            alias = ret.alias_info
            if alias is not None and func not in _NEW_BUFFER_OPS:
                base = self._aliased_input(func, args, kwargs, alias.before_set)
                if base is not None:
                    for t in tensors:
                        self._attach(t, base)
                continue  # a view of a tensor from before the step: nothing allocated
            for t in tensors:
                try:
                    size = t.untyped_storage().nbytes()
                except (RuntimeError, NotImplementedError):
                    size = t.numel() * t.element_size()
                self.buffers.append(_Buffer(size, step, step, str(func.overloadpacket)))
                self._attach(t, len(self.buffers) - 1)

    def _aliased_input(self, func, args, kwargs, alias_set: set[str]) -> int | None:  # type: ignore[no-untyped-def]
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not (arg.alias_info.before_set & alias_set):
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in pytree.tree_leaves(value):
                if isinstance(t, torch.Tensor) and id(t) in self._buffer_of:
                    return self._buffer_of[id(t)]
        return None

    def _attach(self, t: torch.Tensor, buffer: int) -> None:
        key = id(t)
        if key in self._buffer_of:
            return  # the same Python tensor came back (an in-place op returns its input)
        self._buffer_of[key] = buffer
        self.buffers[buffer].num_live_tensors += 1
        self._refs[key] = weakref.ref(t, lambda _, key=key: self._release(key))

    def _release(self, key: int) -> None:
        self._refs.pop(key, None)
        b = self._buffer_of.pop(key, None)
        if b is None:
            return
        buf = self.buffers[b]
        buf.num_live_tensors -= 1
        if buf.num_live_tensors == 0:
            buf.freed = self.num_ops

    def intervals(self, *, eager: bool = False) -> list[Interval]:
        """Lifetimes from allocation to last use, or to the eager free with ``eager=True``.

        Buffers still alive at the end of the recording live until its last op.
        """
        end = max(self.num_ops - 1, 0)
        out = []
        for buf in self.buffers:
            if eager:
                last = end if buf.freed is None else min(max(buf.freed, buf.last), end)
            else:
                last = buf.last
            out.append(Interval(buf.first, last, buf.size, buf.label))
        return out


# NOTE: lift_fresh turns a constant (torch.tensor(list)) into a tensor of the step: its
# schema says "alias of the input", but the input is a temporary outside the dispatcher.
_NEW_BUFFER_OPS = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
_ADDMM_OPS = {torch.ops.aten.addmm.default, torch.ops.aten.addmm.out}
_GEMM_OPS = {torch.ops.aten.mm.default, torch.ops.aten.mm.out, *_ADDMM_OPS}


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
    *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int
) -> dict[str, SchedulerOutput]:
    """The largest steps the scheduler may issue under these limits, by name.

    - ``prefill``: one chunk of the whole token budget at the end of a max-length context
      (it gathers that context and builds a [chunk, context] mask);
    - ``decode``: as many decodes as the limits allow, each at max_model_len (each decode
      group gathers its sequences' blocks, padded to its longest; equal lengths make one
      group). NOTE: the true worst case, not an over-reservation; what tightens it is a
      smaller ``max_model_len``, which ``memory_budget.max_sequence_tokens`` bounds by the
      pool's size when that is fixed;
    - ``mixed``: decodes for all sequences but one, plus a chunk of the remaining budget.
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

    def req(rid: str, num_tokens: int) -> ScheduledRequest:
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
) -> ActivationPlan:
    """Trace the worst-case steps (see ``worst_case_steps``) and plan the most demanding one.

    ``model_factory(arch, dtype=, device=, attn_backend=)`` builds the model to trace
    (``kvserve.models.llama.LlamaForCausalLM``; passed in so runtime/ imports no model).

    Nothing of the model's size is allocated: weights and KV cache are fake tensors.
    ``max_layers`` traces only that many decoder layers (None: all); ``steps`` restricts the
    candidates by name; ``num_threads`` sizes per-thread kernel scratch (None: torch's
    current count). ``chunk_attention``: the native backend's chunk choice, as the engine
    applies it (chunks through the decode kernel hold no gathered copy; chunks through
    float32 SDPA hold float32 copies). Results are cached per argument set (engines built
    with the same options trace once).
    """
    if max_layers is not None:
        if max_layers < 1:
            raise ValueError(f"max_layers must be >= 1 or None, got {max_layers}")
        arch = dataclasses.replace(arch, num_hidden_layers=min(arch.num_hidden_layers, max_layers))
    return _plan_cached(
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
    )


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
) -> ActivationPlan:
    from torch._subclasses.fake_tensor import FakeTensorMode

    candidates = worst_case_steps(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        block_size=block_size,
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
            sliding_window=arch.sliding_window,
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
    "ARENA_ALIGNMENT",
    "ActivationPlan",
    "ArenaPlan",
    "Interval",
    "LifetimeRecorder",
    "WORST_CASE_SAMPLING",
    "describe",
    "live_bytes_lower_bound",
    "pack_intervals",
    "plan_activations",
    "trace_step",
    "worst_case_steps",
]
