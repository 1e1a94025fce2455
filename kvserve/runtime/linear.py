"""The linear-method layer: the one place where a projection ``y = x @ W^T (+ b)`` runs.

A model holds one ``Linear`` per projection (fused qkv, o, gate/up, down, lm_head). A
``Linear`` owns the weight source and the ``LinearMethod`` chosen for each range of M (rows
of ``x``); the model never knows which kernel runs. Methods are built once at load (a
prepacked method copies the weight into its own layout then). Which methods exist for a
weight (the candidate factories the kernels register), which one runs each M bucket and the
building of a ``Linear`` from that choice (``build_linear``) are kernel selection's:
``kvserve.runtime.autotune``. Shapes follow HF: a weight is ``[out_features, in_features]``.
"""

from __future__ import annotations

import abc
import bisect
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from kvserve.runtime.huge_pages import into_huge_pages

# NOTE: the M bound of the last bucket: "every larger M".
M_MAX = sys.maxsize

# Row counts up to this run as they are on a shape-cached kernel; larger ones are padded to
# the next multiple of 1/8 of their power of two (``row_bucket``).
EXACT_ROWS = 16

# The chosen method names per weight shape (out, in): ``(max_m, method name)`` per bucket.
LinearPlan = Mapping[tuple[int, int], Sequence[tuple[int, str]]]

_DTYPE_TAGS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtype_tag(dtype: torch.dtype) -> str:
    """Short name of a float dtype as used in method names ("fp32", "bf16", "fp16")."""
    return _DTYPE_TAGS.get(dtype, str(dtype).removeprefix("torch."))


class LinearMethod(abc.ABC):
    """One way to run ``y = x @ W^T (+ b)`` for one fixed weight, built once at load.

    ``shares_source``: the method reads the weight source's own storage (holds no copy), so
    the memory report does not count its bytes a second time. ``supports_bias``: ``apply``
    adds ``self.bias`` itself (set by ``Linear``); otherwise ``Linear`` adds it afterwards.
    ``allocates``: the kernel always makes its own output tensor (with ``out`` given, ``apply``
    copies it there), so a caller that only reads the result can skip that copy.
    ``shape_cached``: the kernel library builds and keeps a primitive for every distinct M it
    sees (oneDNN), so ``Linear`` calls it with M padded to a few sizes (``row_bucket``).
    ``rebuilds_dtype``: the method holds a copy from which ``dense_weight`` gives back the
    weight exactly, in this dtype (None: it cannot), so the source need not be kept.
    ``min_rows``: the kernel selection neither times nor chooses the method for a bucket probed
    with fewer rows (it still computes any M correctly).
    """

    name: str
    in_features: int
    out_features: int
    shares_source: bool = False
    supports_bias: bool = False
    allocates: bool = False
    shape_cached: bool = False
    rebuilds_dtype: torch.dtype | None = None
    min_rows: int = 1
    bias: torch.Tensor | None = None

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Weight bytes as held (packed / quantized / the shared source)."""

    @abc.abstractmethod
    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [M, in] (the model's activation dtype) -> [M, out], into ``out`` if given."""

    def prepare(self) -> None:
        """Make what the method holds but builds lazily (a copy of the weight), so that
        listing candidates costs nothing; ``Linear`` calls it for the methods it is given,
        so no copy is made on the serving path. A no-op by default."""
        return None

    def dense_weight(self) -> torch.Tensor:
        """The weight ``[out, in]`` rebuilt, exactly, from what this method holds; only for a
        method whose ``rebuilds_dtype`` is set."""
        raise NotImplementedError(f"{self.name} cannot rebuild its dense weight")

    def streamed_tensors(self) -> list[torch.Tensor]:
        """The contiguous CPU tensors a call reads end to end (packed / quantized weights,
        once made), which ``gather_into_huge_pages`` moves; none by default (a library's
        opaque layout, or a weight the method only shares)."""
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, {self.out_features}x{self.in_features})"


class DenseMmMethod(LinearMethod):
    """``torch.mm`` on the weight's ``[in, out]`` view: MKL sgemm in fp32 (the original path).

    NOTE: the model stores its linear weights transposed (see ``linear_param`` in
    models/decoder_layer.py), so ``weight.t()`` is a contiguous ``[in, out]`` operand; for an
    ``[out, in]``-contiguous weight (the tied lm_head) this is exactly ``F.linear``.
    """

    shares_source = True
    supports_bias = True

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # [out, in]
        self.weight_t = weight.t()  # [in, out]
        tag = dtype_tag(weight.dtype)
        self.name = "mkl_fp32" if weight.dtype == torch.float32 else f"mm_{tag}"
        # NOTE: on CPU torch.mm runs fp32 in MKL (nothing kept per shape) but 16-bit dtypes
        # in oneDNN (mkldnn_matmul), which caches a primitive per shape.
        self.shape_cached = weight.device.type == "cpu" and weight.dtype != torch.float32

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.bias is None:
            return torch.mm(x, self.weight_t, out=out)
        return torch.addmm(self.bias, x, self.weight_t, out=out)


class OneDnnPrepackedMethod(LinearMethod):
    """oneDNN (mkldnn) linear on a weight reordered once into its blocked layout.

    The path torch's inductor takes on CPU: ``torch.ops.mkldnn._reorder_linear_weight`` at
    load, ``torch.ops.mkldnn._linear_pointwise`` per call. The op has no ``out=`` form: with
    ``out`` given its result is copied there.
    """

    supports_bias = True
    allocates = True
    shape_cached = True

    def __init__(self, weight: torch.Tensor, *, batch_size_hint: int | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        w = weight.contiguous()  # [out, in]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_size_hint)
        self._nbytes = w.numel() * w.element_size()
        self.name = f"onednn_prepacked_{dtype_tag(weight.dtype)}"
        self.rebuilds_dtype = w.dtype

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def dense_weight(self) -> torch.Tensor:
        """The weight ``[out, in]`` out of the blocked layout (bit for bit the packed one)."""
        return self.packed.to_dense()

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] == 1:
            # NOTE: one row goes through oneDNN's gemv kernel, whose sums run in another
            # order than its GEMM's at some shapes (AMD EPYC Zen 4, fp32 576x1536: a row's bits
            # differed from the same row in any 2..320-row call), so a decode step's logits
            # depended on its batch. Two rows take the GEMM path; the second row cost 1-4 % at
            # 2 threads (16 % on the 49152x576 lm_head at 1 thread). decode_layers.cpp pads
            # its oneDNN parts the same way.
            y = torch.ops.mkldnn._linear_pointwise(
                x.expand(2, -1).contiguous(), self.packed, self.bias, "none", [], ""
            )[:1]
        else:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if out is None:
            return y
        return out.copy_(y)


def row_bucket(num_rows: int) -> int:
    """The row count a shape-cached kernel is called with for ``num_rows`` rows (>= it).

    Up to EXACT_ROWS (decode batches) exact; above, rounded up to a multiple of 1/8 of the
    largest power of two <= ``num_rows``: at most 12.5 % padding, 8 sizes per doubling (56
    sizes up to 512 rows).
    NOTE: why: oneDNN (torch's bf16 matmul on CPU, the prepacked linear) builds a primitive
    per distinct M and keeps it in two caches (oneDNN's ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``
    and ideep's ``LRU_CACHE_CAPACITY``, 1,024 entries each, a few hundred KiB per entry
    here). A serving engine sees a new M almost every step, so unpadded the caches filled
    towards 1,024 entries per cache and RSS kept growing by hundreds of MiB (issue #20's
    soak: +141.8 MiB); padded they hold a few dozen entries per weight and stay warm.
    """
    if num_rows <= EXACT_ROWS:
        return num_rows
    step = 1 << (num_rows.bit_length() - 4)
    return -(-num_rows // step) * step


def rows_view(t: torch.Tensor, rows: int) -> torch.Tensor | None:
    """``t`` [M, n] (dense rows) extended to ``rows`` rows over its own storage, or None
    when the storage ends before that (or ``t`` is not a block of whole, dense rows)."""
    if t.dim() != 2 or t.stride(1) != 1 or t.stride(0) != t.shape[1]:
        return None
    end = (t.storage_offset() + rows * t.stride(0)) * t.element_size()
    if end > t.untyped_storage().nbytes():
        return None
    return t.as_strided((rows, t.shape[1]), t.stride())


def warm_row_buckets(
    linears: Sequence[tuple[Linear, int]], dtype: torch.dtype, device: torch.device
) -> int:
    """Run each distinct shape-cached method of ``linears`` ((Linear, most rows it will see)
    pairs) once at every ``row_bucket`` size up to its most rows; returns the calls made.

    NOTE: at start-up, so the library's per-shape primitives (~0.6 MiB each here, a fixed
    number with row buckets) are part of the start-up footprint instead of RSS growth while
    serving. Methods are told apart by (name, out, in): the library's caches key on shapes,
    not on the weight, so one layer's projection warms every layer's.
    """
    seen: set[tuple[str, int, int, int]] = set()
    calls = 0
    with torch.inference_mode():
        for linear, max_rows in linears:
            sizes = sorted({row_bucket(m) for m in range(1, max_rows + 1)})
            for size in sizes:
                method = linear.method_for(size)
                key = (method.name, method.out_features, method.in_features, size)
                if not method.shape_cached or key in seen:
                    continue
                seen.add(key)
                method.apply(torch.zeros((size, method.in_features), dtype=dtype, device=device))
                calls += 1
    return calls


class Linear:
    """What a model layer holds for one projection: the weight source, an optional bias and
    the method chosen per M bucket; ``linear(x, out)`` picks by ``x.shape[0]``.

    ``buckets``: ``(max_m, method)`` pairs in increasing ``max_m``; a call with M rows runs the
    method of the first bucket with ``M <= max_m`` (the last bucket also takes any larger M).
    """

    __slots__ = ("source", "bias", "buckets", "_bounds", "_methods", "_single")

    def __init__(
        self,
        source: Any,
        buckets: Sequence[tuple[int, LinearMethod]],
        bias: torch.Tensor | None = None,
    ) -> None:
        if not buckets:
            raise ValueError("a Linear needs at least one (max_m, method) bucket")
        bounds = [b for b, _ in buckets]
        if bounds != sorted(set(bounds)):
            raise ValueError(f"bucket bounds must be strictly increasing, got {bounds}")
        self.source = source
        self.bias = bias
        self.buckets = tuple(buckets)
        self._bounds = bounds
        self._methods = [m for _, m in buckets]
        for m in self._methods:
            if m.supports_bias:
                m.bias = bias
            m.prepare()
        # NOTE: one method for every M (the usual case): no bisect on the hot path.
        distinct = {id(m) for m in self._methods}
        self._single = self._methods[0] if len(distinct) == 1 else None

    @property
    def in_features(self) -> int:
        return self._methods[0].in_features

    @property
    def out_features(self) -> int:
        return self._methods[0].out_features

    def methods(self) -> list[LinearMethod]:
        """The distinct methods held, in bucket order."""
        seen: dict[int, LinearMethod] = {}
        for m in self._methods:
            seen.setdefault(id(m), m)
        return list(seen.values())

    @property
    def extra_nbytes(self) -> int:
        """Bytes held beyond the weight source (prepacked / converted copies)."""
        return sum(m.nbytes for m in self.methods() if not m.shares_source)

    def can_free_source(self) -> bool:
        """Whether the weight source may be freed: no method reads it and a held copy in its
        dtype can rebuild it (``rebuild_source``)."""
        source = self.source
        if not isinstance(source, torch.Tensor):
            return False
        methods = self.methods()
        return not any(m.shares_source for m in methods) and any(
            m.rebuilds_dtype == source.dtype for m in methods
        )

    def rebuild_source(self) -> torch.Tensor:
        """The dense weight ``[out, in]`` rebuilt from a held copy (in the copy's dtype).

        Raises ValueError when no held copy can rebuild it.
        """
        for m in self.methods():
            if m.rebuilds_dtype is not None:
                return m.dense_weight()
        raise ValueError(f"{self!r} holds no copy that can rebuild its weight")

    def release_source(self, placeholder: Any) -> None:
        """Drop the reference to the weight source (``placeholder`` takes its place), so
        that its memory is freed once the model drops it too."""
        self.source = placeholder

    def method_for(self, num_rows: int) -> LinearMethod:
        """The method that runs a call with ``num_rows`` rows."""
        if self._single is not None:
            return self._single
        i = bisect.bisect_left(self._bounds, num_rows)
        return self._methods[min(i, len(self._methods) - 1)]

    def __call__(
        self,
        x: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        out_is_hint: bool = False,
        out_rows_free: bool = False,
    ) -> torch.Tensor:
        """``x`` [M, in] -> [M, out] (into ``out`` when given).

        ``out_is_hint``: the caller only reads the returned tensor, so a method that allocates
        its own output returns that instead of copying it into ``out``.
        ``out_rows_free``: the storage past ``out``'s last row is scratch (a ``Workspace``
        buffer): a kernel run on padded rows (``row_bucket``) may write its padding there.
        """
        method = self._single if self._single is not None else self.method_for(x.shape[0])
        if method.shape_cached and row_bucket(x.shape[0]) != x.shape[0]:
            return self._padded(method, x, out, out_is_hint, out_rows_free)
        y = method.apply(x, None if out_is_hint and method.allocates else out)
        if self.bias is not None and not method.supports_bias:
            y.add_(self.bias)
        return y

    def _padded(
        self,
        method: LinearMethod,
        x: torch.Tensor,
        out: torch.Tensor | None,
        out_is_hint: bool,
        out_rows_free: bool,
    ) -> torch.Tensor:
        """``method`` on ``x`` [M, in] padded to ``row_bucket(M)`` rows; the first M rows of
        the result (into ``out`` unless it is only a hint).

        NOTE: without copies where the storage allows: an ``x`` whose storage holds the
        padded rows (a ``Workspace`` buffer) is read in place, pad rows and all (each output
        row depends on its own input row only, so what they hold changes no result row), and
        the result goes straight into ``out`` when its pad rows are free (``out_rows_free``)
        or comes back as the kernel's own tensor when ``out`` is a hint. At a 513-row step the
        copies in and out were 13 ms of 190 (AMX Xeon, bf16).
        """
        num_rows = x.shape[0]
        rows = row_bucket(num_rows)
        xp = rows_view(x, rows)
        if xp is None:
            xp = x.new_empty((rows, x.shape[1]))  # [Mb, in]
            xp[:num_rows].copy_(x)
            xp[num_rows:].zero_()
        outp = rows_view(out, rows) if out is not None and out_rows_free else None
        in_place = outp is not None and not (out_is_hint and method.allocates)
        if in_place:
            method.apply(xp, outp)
            y = out  # [M, out]: the leading rows of outp
        else:
            y = method.apply(xp)[:num_rows]  # [M, out], the leading rows of [Mb, out]
        if self.bias is not None and not method.supports_bias:
            y.add_(self.bias)  # type: ignore[union-attr]
        if in_place or out is None or out_is_hint:
            return y  # type: ignore[return-value]
        return out.copy_(y)

    def __repr__(self) -> str:
        parts = ", ".join(f"M<={'inf' if b == M_MAX else b}:{m.name}" for b, m in self.buckets)
        return f"Linear({self.out_features}x{self.in_features}; {parts})"


def gather_into_huge_pages(linears: Iterable[Linear]) -> int:
    """Move the weights every method of ``linears`` (a model's ``linears()``) streams
    (``LinearMethod.streamed_tensors``: AMX tiles, int8-dot blocks, dense copies) into one
    buffer in huge pages (runtime/huge_pages.py); returns the bytes moved.

    Each tensor is re-pointed in place (``Tensor.set_``), so every holder of it (a method, the
    ``QuantizedWeight`` a kernel and a dense copy share) reads the new buffer.

    NOTE: why. A decode step streams every weight once; in 4 KiB pages that is a TLB miss
    every 4 KiB. The embedded model's projection sequence (30 layers x 4, AMX, 2 threads)
    ran 13-23 % faster at M = 1-64 with its weights in one huge-page buffer
    (the AMX Xeon, 2026-12-02, 6778ddc: ``bench/probes/amx_model_ab.py --huge-pages`` at
    25ace60); docs/memory.md has the quantized model's figures.
    """
    seen: dict[int, torch.Tensor] = {}
    for lin in linears:
        for method in lin.methods():
            for t in method.streamed_tensors():
                seen.setdefault(id(t), t)
    tensors = [t for t in seen.values() if t.device.type == "cpu"]
    if not tensors:
        return 0
    for old, moved in zip(tensors, into_huge_pages(tensors), strict=True):
        old.set_(moved)
    return sum(t.nbytes for t in tensors)
