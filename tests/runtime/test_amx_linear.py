"""The AMX linear method (``kvserve/runtime/amx_linear.py``, ``native/csrc/amx_linear.cpp``).

The packing and the candidate rules are checked everywhere; the kernel only where the CPU
has AMX-BF16 (the tests say so when they skip).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.models.quant import quantize_dense
from kvserve.models.quant_linear import DequantAmxMethod, DequantDenseMethod, quantized_candidates
from kvserve.runtime.amx_linear import (
    AmxBf16Method,
    amx_available,
    amx_candidates,
    pack_weight,
    unpack_weight,
)
from kvserve.runtime.linear import M_MAX, Linear, gather_into_huge_pages

CPU = torch.device("cpu")
needs_amx = pytest.mark.skipif(not amx_available(), reason="no AMX-BF16 on this CPU/build")


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 output: one rounding of an fp32 sum (plus summation order)."""
    assert got.shape == ref.shape
    if ref.numel() == 0:
        return
    scale = ref.abs().max().item() or 1.0
    err = (got.float() - ref).abs().max().item()
    assert err <= 1e-2 * scale, (err, scale)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 80), k=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_packing_places_every_element_and_pads_with_zeros(n: int, k: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    p = pack_weight(w)
    groups, kblocks = -(-n // 32), -(-k // 32)
    assert p.shape == (groups, kblocks, 2, 16, 32) and p.dtype == torch.bfloat16
    # element [g, kb, nb, kp, 2c + j] = w[32g + 16nb + c, 32kb + 2kp + j], zero past n / k
    g, kb, nb, kp, c, j = torch.meshgrid(
        *(torch.arange(s) for s in (groups, kblocks, 2, 16, 16, 2)), indexing="ij"
    )
    rows, cols = 32 * g + 16 * nb + c, 32 * kb + 2 * kp + j
    inside = (rows < n) & (cols < k)
    expect = torch.zeros(rows.shape, dtype=torch.bfloat16)
    expect[inside] = w[rows[inside], cols[inside]]
    assert torch.equal(p.view(groups, kblocks, 2, 16, 16, 2), expect)
    assert torch.equal(unpack_weight(p, n, k), w)


def test_an_empty_weight_cannot_be_packed() -> None:
    with pytest.raises(ValueError, match="non-zero, got 0x8"):
        pack_weight(torch.zeros(0, 8, dtype=torch.bfloat16))


def test_no_candidate_outside_bf16_on_cpu() -> None:
    w = torch.randn(64, 64)
    assert amx_candidates(w, act_dtype=torch.float32, device=CPU) == []
    assert amx_candidates(w, act_dtype=torch.bfloat16, device=torch.device("cuda")) == []
    assert amx_candidates(torch.zeros(0, 64), act_dtype=torch.bfloat16, device=CPU) == []
    offered = [m.name for m in amx_candidates(w, act_dtype=torch.bfloat16, device=CPU)]
    assert offered == (["amx_bf16"] if amx_available() else [])


@needs_amx
@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(0, 70),
    n=st.integers(1, 100),
    k=st.integers(1, 100),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_the_fp32_product(m: int, n: int, k: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    method = AmxBf16Method(w)
    method.prepare()
    _close(method.apply(x), x.float() @ w.float().t())


@needs_amx
def test_writes_only_its_columns_of_a_wider_out_and_reads_strided_rows() -> None:
    w = torch.randn(70, 96).to(torch.bfloat16)
    x_wide = torch.randn(20, 130).to(torch.bfloat16)
    x = x_wide[:, 3:99]  # [20, 96], row stride 130
    out = torch.full((20, 80), 7.0, dtype=torch.bfloat16)
    method = AmxBf16Method(w)
    method.prepare()
    got = method.apply(x, out[:, 5:75])
    assert got.data_ptr() == out[:, 5:75].data_ptr()
    _close(got, x.float() @ w.float().t())
    assert (out[:, :5] == 7).all() and (out[:, 75:] == 7).all()
    assert torch.equal(method.apply(x.t().contiguous().t()), method.apply(x.contiguous()))


@needs_amx
def test_linear_adds_the_bias_and_the_packed_copy_rebuilds_the_weight() -> None:
    w = torch.randn(96, 64).to(torch.bfloat16)
    b = torch.randn(96).to(torch.bfloat16)
    x = torch.randn(9, 64).to(torch.bfloat16)
    lin = Linear(w, [(M_MAX, AmxBf16Method(w))], b)
    _close(lin(x), x.float() @ w.float().t() + b.float())
    assert lin.can_free_source()
    assert torch.equal(lin.rebuild_source(), w)


@needs_amx
def test_gathering_into_huge_pages_moves_every_packed_weight_and_keeps_the_outputs() -> None:
    ws = [torch.randn(n, 64).to(torch.bfloat16) for n in (96, 40, 96)]
    shared = AmxBf16Method(ws[2])
    copy = DequantAmxMethod(quantize_dense(torch.randn(64, 64), "q8_0"), torch.bfloat16)
    lins = [
        Linear(ws[0], [(M_MAX, AmxBf16Method(ws[0]))]),
        Linear(ws[1], [(8, AmxBf16Method(ws[1])), (M_MAX, AmxBf16Method(ws[1]))]),
        Linear(ws[2], [(8, shared), (M_MAX, shared)]),  # one method in two buckets: moved once
        Linear(copy.source, [(M_MAX, copy)]),  # the AMX tiles inside a quantized weight's copy
    ]
    x = torch.randn(5, 64).to(torch.bfloat16)
    before = [lin(x) for lin in lins]
    packed = [m.packed for lin in lins[:3] for m in lin.methods()] + [copy.packed.packed]
    assert gather_into_huge_pages(lins) == sum(t.nbytes for t in packed)
    assert len({t.untyped_storage().data_ptr() for t in packed}) == 1
    for lin, y in zip(lins, before, strict=True):
        assert torch.equal(lin(x), y)


@needs_amx
def test_bad_input_is_rejected_by_name() -> None:
    method = AmxBf16Method(torch.randn(64, 64).to(torch.bfloat16))
    method.prepare()
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        method.apply(torch.randn(4, 64))
    with pytest.raises(RuntimeError, match=r"ceil\(K/32\) = 2"):
        method.apply(torch.randn(4, 96).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"ceil\(N/32\) = 2"):
        method.apply(
            torch.randn(4, 64).to(torch.bfloat16), torch.empty(4, 20, dtype=torch.bfloat16)
        )


@needs_amx
def test_a_quantized_weight_offers_the_amx_copy_and_it_matches_the_dense_one() -> None:
    q = quantize_dense(torch.randn(96, 64), "q8_0")
    names = [m.name for m in quantized_candidates(q, act_dtype=torch.bfloat16, device=CPU)]
    assert "dequant_amx_bf16" in names
    assert "dequant_amx_bf16" not in [
        m.name for m in quantized_candidates(q, act_dtype=torch.float32, device=CPU)
    ]
    x = torch.randn(12, 64).to(torch.bfloat16)
    amx, dense = DequantAmxMethod(q, torch.bfloat16), DequantDenseMethod(q, torch.float32)
    _close(amx.apply(x), dense.apply(x.float()))
