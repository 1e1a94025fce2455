"""int8 weights on AMX int8 tiles (``kvserve/runtime/amx_int8.py``, ``native/csrc/amx_int8.cpp``)
and their candidate ``QuantAmxInt8Method``.

The packing is checked everywhere; the kernel only where the CPU has AMX-INT8 (the tests say
so when they skip). The kernel's reference is exact: the integer dot products of the same
int8 values (``quantize_activations``, ``unpack_int8_weight``) scaled per block in float64,
so the only difference allowed is the bf16 rounding of the output.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.models.quant import QuantizedWeight, quantize_dense
from kvserve.models.quant_linear import QuantAmxInt8Method, kernel_layout, quantized_candidates
from kvserve.runtime import native
from kvserve.runtime.amx_int8 import (
    BLOCK_BYTES,
    amx_int8_available,
    pack_int8_weight,
    packed_shape,
    quantize_activations,
    quantize_blocks,
    unpack_int8_weight,
)
from kvserve.runtime.linear import M_MAX, Linear

CPU = torch.device("cpu")
needs_amx_int8 = pytest.mark.skipif(
    not (native.load() and amx_int8_available()), reason="no AMX-INT8 on this CPU/build"
)


def reference(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """float64 [M, N]: the kernel's result before its bf16 rounding."""
    k = x.shape[1]
    qx, sx = quantize_activations(x)
    qw, sw = unpack_int8_weight(packed, n, k)
    out = torch.zeros(x.shape[0], n, dtype=torch.float64)
    for b in range(sx.shape[1]):
        cols = slice(64 * b, min(k, 64 * b + 64))
        dot = qx[:, cols].double() @ qw[:, cols].double().t()  # exact integers
        out += dot * sx[:, b : b + 1].double() * sw[:, b].double()[None]
    return out


def assert_rounded(got: torch.Tensor, ref: torch.Tensor) -> None:
    """``got`` (bf16) is ``ref`` rounded once to bf16: within half a bf16 step of each value,
    plus the fp32 summation's error."""
    err = (got.double() - ref).abs()
    assert bool((err <= ref.abs() * 2.0**-8 + 1e-6 * ref.abs().max()).all()), err.max()


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 80), k=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_packing_places_every_value_and_scale(n: int, k: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    packed = pack_int8_weight(w)
    assert packed.shape == packed_shape(n, k) and packed.dtype == torch.int8
    q, scale = quantize_blocks(w)
    got_q, got_scale = unpack_int8_weight(packed, n, k)
    assert torch.equal(got_q, q[:n, :k]) and torch.equal(got_scale, scale[:n])
    # Byte [g, kb, nb, kq, 4c + j] is q[32g + 16nb + c, 64kb + 4kq + j].
    blocks = packed.view(packed.shape[0], -1, BLOCK_BYTES)
    g, kb, nb, kq, c, j = 0, 0, 1 if n > 16 else 0, 1 if k > 4 else 0, min(n - 1, 15) % 16, 0
    assert blocks[g, kb, nb * 1024 + kq * 64 + 4 * c + j] == q[16 * nb + c, 4 * kq + j]
    # Each value within half a step of its block's scale; padding is zeros.
    deq = got_q.float() * got_scale.repeat_interleave(64, dim=1)[:, :k]
    step = got_scale.repeat_interleave(64, dim=1)[:, :k]
    assert bool(((deq - w).abs() <= step / 2 + 1e-6).all())
    assert bool((q[n:] == 0).all()) and bool((q[:, k:] == 0).all())


def test_a_weight_it_cannot_pack_says_why() -> None:
    with pytest.raises(ValueError, match="non-zero, got 0x8"):
        pack_int8_weight(torch.zeros(0, 8))
    with pytest.raises(ValueError, match="finite"):
        pack_int8_weight(torch.tensor([[1.0, float("inf")]]))


def test_a_zero_block_has_scale_zero_and_zero_values() -> None:
    w = torch.zeros(3, 130)
    w[1, 70] = -2.0
    q, scale = quantize_blocks(w)
    assert scale[0].eq(0).all() and q[0].eq(0).all()
    assert scale[1, 1].item() == pytest.approx(2.0 / 127) and q[1, 70].item() == -127


@needs_amx_int8
@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 70),
    n=st.integers(1, 100),
    k=st.sampled_from([1, 37, 64, 96, 130, 576]),
    seed=st.integers(0, 2**16),
)
def test_kernel_is_the_exact_block_sums_rounded_once(m: int, n: int, k: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    x = (torch.randn(m, k, generator=gen) * 3).to(torch.bfloat16)
    packed = pack_int8_weight(w)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    torch.ops.kvserve.amx_int8_linear(out, x, packed)
    assert_rounded(out, reference(x, packed, n))


@needs_amx_int8
def test_kernel_writes_only_its_columns_of_a_wider_buffer() -> None:
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(40, 96, generator=gen), torch.randn(5, 96, generator=gen).bfloat16()
    buf = torch.full((5, 100), 7.0, dtype=torch.bfloat16)
    torch.ops.kvserve.amx_int8_linear(buf[:, 30:70], x, pack_int8_weight(w))
    assert_rounded(buf[:, 30:70], reference(x, pack_int8_weight(w), 40))
    assert bool((buf[:, :30] == 7).all()) and bool((buf[:, 70:] == 7).all())


@needs_amx_int8
def test_zero_rows_give_zeros_and_non_finite_rows_give_nan_in_their_row_only() -> None:
    w = torch.randn(20, 128, generator=torch.Generator().manual_seed(2))
    x = torch.randn(4, 128).bfloat16()
    x[0] = 0
    x[1, 100] = float("nan")
    x[2, 3] = float("inf")
    out = torch.empty(4, 20, dtype=torch.bfloat16)
    torch.ops.kvserve.amx_int8_linear(out, x, pack_int8_weight(w))
    assert bool((out[0] == 0).all())
    assert bool(out[1].isnan().all()) and bool(out[2].isnan().all())
    assert bool(out[3].isfinite().all())


@needs_amx_int8
def test_bad_arguments_name_what_is_wrong() -> None:
    packed = pack_int8_weight(torch.randn(40, 96))
    x = torch.randn(3, 96).bfloat16()
    wrong_k = r"int8 \[2, 2176\] tensor for N = 40, K = 64, got \[2, 4352\]"
    with pytest.raises(RuntimeError, match=wrong_k):
        torch.ops.kvserve.amx_int8_linear(torch.empty(3, 40).bfloat16(), x[:, :64], packed)
    with pytest.raises(RuntimeError, match="x and out must be bfloat16"):
        torch.ops.kvserve.amx_int8_linear(torch.empty(3, 40), x.float(), packed)
    with pytest.raises(RuntimeError, match="out has 2 rows, x has 3"):
        torch.ops.kvserve.amx_int8_linear(torch.empty(2, 40).bfloat16(), x, packed)


def _q4_1(n: int, k: int, seed: int = 0) -> QuantizedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return kernel_layout(quantize_dense(w, "q4_1"), "x16")


def test_offered_for_quantized_bf16_weights_only() -> None:
    names = {
        m.name for m in quantized_candidates(_q4_1(64, 64), act_dtype=torch.bfloat16, device=CPU)
    }
    assert ("int8_amx" in names) == (native.load() and amx_int8_available())
    fp32 = quantized_candidates(_q4_1(64, 64), act_dtype=torch.float32, device=CPU)
    assert "int8_amx" not in {m.name for m in fp32}
    dense = quantized_candidates(torch.randn(64, 64), act_dtype=torch.bfloat16, device=CPU)
    assert dense == []  # a dense weight is not the quantized factory's


@needs_amx_int8
def test_method_runs_the_quantized_weight_and_holds_the_packed_copy() -> None:
    weight = _q4_1(96, 576)
    method = QuantAmxInt8Method(weight)
    assert method.packed is None and not method.shares_source  # made by prepare, not listing
    lin = Linear(weight, [(M_MAX, method)])
    assert method.packed is not None and method.nbytes == method.packed.numel()
    assert lin.extra_nbytes == 3 * 9 * BLOCK_BYTES
    assert method.streamed_tensors() == [method.packed]
    x = torch.randn(20, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = lin(x)
    assert_rounded(got, reference(x, method.packed, 96))
    dense = x.double() @ weight.dequantize(torch.float32).double().t()
    assert (got.double() - dense).abs().max() <= 0.03 * dense.abs().max()
