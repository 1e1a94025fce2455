"""Row buckets for shape-cached kernels (``kvserve/runtime/linear.py``, issue #20's RSS growth).

oneDNN keeps a primitive per distinct M; ``Linear`` calls such a method only at
``row_bucket`` sizes, so the set of shapes a method ever sees stays small and fixed, and
``warm_row_buckets`` builds exactly that set at start-up. Padding never changes a result.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.runtime.autotune.candidates import onednn_available
from kvserve.runtime.linear import (
    EXACT_ROWS,
    DenseMmMethod,
    Linear,
    LinearMethod,
    OneDnnPrepackedMethod,
    row_bucket,
    warm_row_buckets,
)


class ShapeRecordingMethod(LinearMethod):
    """torch.mm that records every M it is called with (a stand-in for a oneDNN primitive
    cache), optionally shape-cached and allocating its own output."""

    def __init__(self, weight: torch.Tensor, *, shape_cached: bool, allocates: bool) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # [out, in]
        self.shape_cached = shape_cached
        self.allocates = allocates
        self.name = "recording"
        self.seen: set[int] = set()

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self.seen.add(x.shape[0])
        y = x @ self.weight.t()  # [M, out]
        return y if out is None else out.copy_(y)


def test_row_bucket_pads_at_most_an_eighth_and_has_few_sizes() -> None:
    for m in range(1, 5000):
        b = row_bucket(m)
        assert m <= b and (b == m if m <= EXACT_ROWS else b <= m * 1.125)
        assert row_bucket(b) == b  # a bucket is its own bucket
    assert len({row_bucket(m) for m in range(1, 513)}) == 56
    assert len({row_bucket(m) for m in range(1, 8193)}) == 16 + 8 * 9


@pytest.mark.parametrize("allocates", [False, True])
@pytest.mark.parametrize("with_out", ["none", "out", "hint"])
def test_shape_cached_method_sees_only_bucket_sizes_and_results_are_exact(
    allocates: bool, with_out: str
) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 16, generator=gen)  # [out, in]
    bias = torch.randn(24, generator=gen)
    method = ShapeRecordingMethod(weight, shape_cached=True, allocates=allocates)
    linear = Linear(weight, [(10**9, method)], bias)
    for m in range(1, 300):
        x = torch.randn(m, 16, generator=gen)  # [M, in]
        out = torch.full((m, 24), float("nan")) if with_out != "none" else None
        y = linear(x, out, out_is_hint=with_out == "hint")
        assert y.shape == (m, 24)
        torch.testing.assert_close(y, x @ weight.t() + bias, rtol=1e-5, atol=1e-5)
        padded = row_bucket(m) != m  # a hint is then left for the kernel's own tensor
        if with_out == "out" or (with_out == "hint" and not allocates and not padded):
            assert y.data_ptr() == out.data_ptr()  # type: ignore[union-attr]
    assert method.seen == {row_bucket(m) for m in range(1, 300)}
    assert len(method.seen) == len({row_bucket(m) for m in range(1, 300)}) < 60


class PointerRecordingMethod(ShapeRecordingMethod):
    """Records the storage it read and wrote (to see copies that padding made)."""

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self.read_ptr, self.wrote_ptr = x.data_ptr(), None if out is None else out.data_ptr()
        return super().apply(x, out)


@pytest.mark.parametrize("allocates", [False, True])
@pytest.mark.parametrize("rows_free", [False, True])
def test_padding_runs_in_place_where_the_storage_has_the_rows(
    allocates: bool, rows_free: bool
) -> None:
    """Leading rows of bigger buffers (a Workspace's): x is read in place, pad rows and all;
    the result goes into ``out`` directly only when its pad rows are declared free, and the
    storage past ``out`` is never written otherwise. Results are exact either way."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(24, 16, generator=gen)  # [out, in]
    method = PointerRecordingMethod(weight, shape_cached=True, allocates=allocates)
    linear = Linear(weight, [(10**9, method)])
    for m in (17, 33, 130, 300):
        assert row_bucket(m) != m
        xbuf = torch.randn(row_bucket(m), 16, generator=gen)  # [Mb, in]; rows >= m: garbage
        obuf = torch.full((row_bucket(m), 24), 7.0)
        x, out = xbuf[:m], obuf[:m]
        y = linear(x, out, out_rows_free=rows_free)
        assert y.data_ptr() == out.data_ptr()
        torch.testing.assert_close(out, x @ weight.t(), rtol=1e-5, atol=1e-5)
        assert method.read_ptr == xbuf.data_ptr()  # no copy of x
        assert (method.wrote_ptr == obuf.data_ptr()) == rows_free
        if not rows_free:
            assert torch.equal(obuf[m:], torch.full_like(obuf[m:], 7.0))
        exact = torch.randn(m, 16, generator=gen)  # a storage without the rows: copied
        linear(exact)
        assert method.read_ptr != exact.data_ptr()


def test_a_method_that_is_not_shape_cached_runs_every_m_as_is() -> None:
    weight = torch.randn(8, 4)
    method = ShapeRecordingMethod(weight, shape_cached=False, allocates=False)
    linear = Linear(weight, [(10**9, method)])
    for m in range(1, 40):
        linear(torch.randn(m, 4))
    assert method.seen == set(range(1, 40))


def test_warm_row_buckets_builds_every_size_a_step_can_use_once() -> None:
    weight = torch.randn(8, 4)
    method = ShapeRecordingMethod(weight, shape_cached=True, allocates=True)
    lin_a = Linear(weight, [(10**9, method)])
    lin_b = Linear(weight, [(10**9, method)])  # another layer, same method name and shape
    calls = warm_row_buckets([(lin_a, 200), (lin_b, 200)], torch.float32, torch.device("cpu"))
    warmed = set(method.seen)
    assert warmed == {row_bucket(m) for m in range(1, 201)} and calls == len(warmed)
    for m in range(1, 201):  # serving afterwards adds no new shape
        lin_b(torch.randn(m, 4))
    assert method.seen == warmed
    plain = ShapeRecordingMethod(weight, shape_cached=False, allocates=False)
    assert warm_row_buckets([(Linear(weight, [(10**9, plain)]), 50)], torch.float32,
                            torch.device("cpu")) == 0  # fmt: skip
    assert plain.seen == set()


def test_which_dense_methods_are_shape_cached() -> None:
    assert not DenseMmMethod(torch.randn(8, 4)).shape_cached  # fp32: MKL, nothing per shape
    assert DenseMmMethod(torch.randn(8, 4).to(torch.bfloat16)).shape_cached  # oneDNN matmul
    if onednn_available():
        assert OneDnnPrepackedMethod(torch.randn(8, 4)).shape_cached
