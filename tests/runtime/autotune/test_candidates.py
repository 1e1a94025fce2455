"""The candidates: a ``Linear`` dispatching by rows, ``build_linear``'s fallback, and every
real candidate's numerics vs fp32 ``F.linear``."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.runtime.autotune import candidates
from kvserve.runtime.autotune.candidates import build_linear, candidate_methods, dense_candidates
from kvserve.runtime.linear import M_MAX, Linear

from .fakes import CPU, FakeMethod


def test_linear_dispatches_by_rows_and_adds_bias_for_methods_without_it() -> None:
    w = torch.randn(6, 4)
    bias = torch.randn(6)
    small, big = FakeMethod(w, "small"), FakeMethod(w, "big")
    lin = Linear(w, [(8, small), (M_MAX, big)], bias)
    assert lin.method_for(1) is small and lin.method_for(8) is small
    assert lin.method_for(9) is big and lin.method_for(10_000) is big
    x = torch.randn(3, 4)
    torch.testing.assert_close(lin(x), F.linear(x, w, bias))
    with pytest.raises(ValueError, match="increasing"):
        Linear(w, [(8, small), (8, big)])


def test_build_linear_falls_back_to_mm_when_oneDNN_is_absent(monkeypatch, caplog) -> None:
    monkeypatch.setattr(candidates, "onednn_available", lambda: False)
    w = torch.randn(12, 8)
    names = [m.name for m in dense_candidates(w, act_dtype=torch.float32, device=CPU)]
    assert names == ["mkl_fp32"]
    with caplog.at_level(logging.WARNING):
        lin = build_linear(
            w, act_dtype=torch.float32, device=CPU, choice=[(M_MAX, "onednn_prepacked_fp32")]
        )
    assert lin.methods()[0].name == "mkl_fp32"
    assert any("unavailable" in r.getMessage() for r in caplog.records)


# ---- every real candidate vs fp32 F.linear ------------------------------------------------

# NOTE: max |error| relative to max |reference|. fp32 candidates differ from F.linear only in
# summation order; bf16 candidates round x and W to bf16 (8 significant bits, 2^-9 relative
# each) and the output too, so a sum of K terms of random sign stays well inside 3e-2.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 600),
    half_n=st.integers(1, 300),
    k=st.integers(1, 700),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_real_candidates_match_fp32_linear(m, half_n, k, dtype, bias, seed) -> None:
    n = 2 * half_n + 1  # odd N
    gen = torch.Generator().manual_seed(seed)
    w32 = torch.randn(k, n, generator=gen).t()  # [n, k], the model's transposed storage
    x32 = torch.randn(m, k, generator=gen)
    b32 = torch.randn(n, generator=gen) if bias else None
    ref = F.linear(x32, w32, b32)  # [m, n]
    w, x = w32.to(dtype), x32.to(dtype)
    b = b32.to(dtype) if b32 is not None else None
    methods = candidate_methods(w, act_dtype=dtype, device=CPU)
    assert methods, "no candidate for a dense weight"
    for method in methods:
        lin = Linear(w, [(M_MAX, method)], b)
        out = torch.empty(m, n, dtype=dtype)
        got = lin(x, out)
        assert got.data_ptr() == out.data_ptr(), method.name
        err = (got.float() - ref).abs().max().item()
        scale = ref.abs().max().item() or 1.0
        assert err <= TOLERANCE[dtype] * scale, (method.name, m, n, k, err, scale)
        assert lin(x).shape == (m, n)  # out=None allocates
