"""Batch-invariant kernel selection (``autotune.invariant``): the row-invariance probe tells a
row-wise kernel from one whose rows depend on the call's size, and the choice keeps one
row-invariant method per shape for every bucket."""

from __future__ import annotations

import pytest
import torch

from kvserve.runtime.autotune.candidates import m_buckets
from kvserve.runtime.autotune.invariant import choose_invariant, rows_invariant
from kvserve.runtime.autotune.measure import Timing
from kvserve.runtime.linear import LinearMethod
from kvserve.runtime.native import quant_ops

from .fakes import CPU, FakeMethod


class RowLoopMethod(FakeMethod):
    """Each row on its own (``torch.mv``): row-invariant by construction."""

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.stack([torch.mv(self.weight, row) for row in x])
        return y if out is None else out.copy_(y)


class SizeDependentMethod(FakeMethod):
    """Float32 sums below 9 rows, float64 sums rounded to float32 from 9: the last bits of a
    row change with the call's size, as MKL's small-M path did (module doc of invariant.py)."""

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] < 9:
            y = torch.stack([torch.mv(self.weight, row) for row in x])
        else:
            y = (x.double() @ self.weight.double().t()).float()
        return y if out is None else out.copy_(y)


def test_probe_tells_row_invariant_kernels_from_size_dependent_ones() -> None:
    w = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    assert rows_invariant(RowLoopMethod(w, "rows"), torch.float32, CPU)
    assert not rows_invariant(SizeDependentMethod(w, "sized"), torch.float32, CPU)
    # capped at a shape's largest M: below 9 rows the size-dependent kernel is consistent
    assert rows_invariant(SizeDependentMethod(w, "sized"), torch.float32, CPU, max_rows=8)


class GemvSometimesMethod(FakeMethod):
    """A one-row call sums in float64 for rows whose first element is positive (about half),
    as a gemv kernel differs on some rows only: torch.mm in bf16 on a Zen 4 EPYC differed in
    5-10 % of single rows, and a probe of rows 0 and 159 alone passed it."""

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] == 1 and x[0, 0] > 0:
            y = (x.double() @ self.weight.double().t()).float()
        else:
            y = torch.stack([torch.mv(self.weight, row) for row in x])
        return y if out is None else out.copy_(y)


def test_probe_checks_many_single_rows() -> None:
    w = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    x = torch.randn(320, 40, generator=torch.Generator().manual_seed(0))
    assert x[0, 0] <= 0 and x[159, 0] <= 0  # the rows the probe used to take alone
    assert not rows_invariant(GemvSometimesMethod(w, "gemv"), torch.float32, CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_one_row_equals_its_rows_in_a_batch(dtype: torch.dtype) -> None:
    """oneDNN's one-row (gemv) kernel summed in another order than its GEMM (Zen 4 EPYC,
    fp32 576x1536): OneDnnPrepackedMethod runs one row as two."""
    from kvserve.runtime.autotune.candidates import onednn_supports
    from kvserve.runtime.linear import OneDnnPrepackedMethod

    if not onednn_supports(dtype):
        pytest.skip(f"oneDNN has no {dtype} linear on this CPU")
    gen = torch.Generator().manual_seed(0)
    method = OneDnnPrepackedMethod((torch.randn(576, 1536, generator=gen) * 0.05).to(dtype))
    method.bias = None
    x = torch.randn(64, 1536, generator=gen).to(dtype)
    full = method.apply(x)
    for i in range(x.shape[0]):
        assert torch.equal(method.apply(x[i : i + 1].clone()), full[i : i + 1]), i


@pytest.mark.skipif(not quant_ops.load(), reason="quantized kernels unavailable")
def test_the_int8_dot_kernel_is_row_invariant() -> None:
    from kvserve.models.quant import quantize_dense
    from kvserve.models.quant_linear import QuantKernelMethod

    w = quantize_dense(torch.randn(48, 64, generator=torch.Generator().manual_seed(1)), "q4_1")
    for weight in (w, w.interleaved()):
        assert rows_invariant(QuantKernelMethod(weight), torch.float32, CPU)


def _timings(shape: tuple[int, int], costs: dict[str, tuple[float, float]], shares: set[str]):  # type: ignore[no-untyped-def]
    """Per candidate (small-M seconds, large-M seconds): buckets up to 32 rows take the first."""
    out = []
    for max_m, probe_m in m_buckets():
        for name, (small, large) in costs.items():
            secs = small if probe_m <= 32 else large
            out.append(Timing(*shape, max_m, probe_m, name, secs, 0, "", name in shares))
    return out


def _choose(costs, shares, invariant, margin=0.05):  # type: ignore[no-untyped-def]
    shape = (24, 40)
    w = torch.randn(shape)

    def factory(source, *, act_dtype, device):  # type: ignore[no-untyped-def]
        return [FakeMethod(source, n, shares=n in shares) for n in costs]

    def probe(method: LinearMethod, dtype, device, limit) -> bool:  # type: ignore[no-untyped-def]
        return method.name in invariant

    plan = choose_invariant(
        _timings(shape, costs, shares),
        {shape: w},
        act_dtype=torch.float32,
        device=CPU,
        buckets=m_buckets(),
        factories=[factory],
        margin=margin,
        probe=probe,
    )
    names = {name for _, name in plan[shape]}
    assert len(plan[shape]) == len(m_buckets()) and len(names) == 1
    return names.pop()


def test_one_method_for_every_bucket_the_least_relative_time() -> None:
    # "decode" is best at 4 small buckets, 2x slower at 3 large; "prefill" 3x slower small
    costs = {"decode": (1.0, 2.0), "prefill": (3.0, 1.0)}
    assert _choose(costs, {"decode", "prefill"}, {"decode", "prefill"}) == "decode"


def test_a_faster_kernel_whose_rows_depend_on_the_batch_is_passed_over() -> None:
    costs = {"fast": (1.0, 1.0), "steady": (1.5, 1.5)}
    assert _choose(costs, {"fast", "steady"}, {"steady"}) == "steady"


def test_a_copy_must_win_by_the_margin() -> None:
    costs = {"shared": (1.0, 1.0), "copy": (0.97, 0.97)}
    assert _choose(costs, {"shared"}, {"shared", "copy"}) == "shared"
    costs = {"shared": (1.0, 1.0), "copy": (0.9, 0.9)}
    assert _choose(costs, {"shared"}, {"shared", "copy"}) == "copy"


def test_no_invariant_candidate_keeps_the_best_and_warns(caplog) -> None:  # type: ignore[no-untyped-def]
    costs = {"a": (1.0, 1.0), "b": (2.0, 2.0)}
    with caplog.at_level("WARNING"):
        assert _choose(costs, {"a", "b"}, set()) == "a"
    assert "no batch-invariant kernel for the 24x40 projection" in caplog.text
