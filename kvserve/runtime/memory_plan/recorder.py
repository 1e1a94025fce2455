"""Record every buffer a traced step allocates, with its size and lifetime (``LifetimeRecorder``).

A ``TorchDispatchMode`` that walks each aten op's schema: new outputs are buffers of the step,
outputs that alias an input (views, in-place ops) are uses of that input's buffer. Kernel
scratch that ``kernel_scratch.py`` models is added as a buffer of its op, and the step's GEMM
shapes are collected. ``intervals`` gives the lifetimes to pack (``arena.pack_intervals``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from kvserve.runtime.kernel_scratch import (
    GemmShape,
    amx_prefill_scratch_bytes,
    gemm_shape,
    native_decode_scratch_bytes,
    sdpa_cpu_flash_scratch_bytes,
)
from kvserve.runtime.memory_plan.arena import Interval


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


__all__ = ["LifetimeRecorder"]
