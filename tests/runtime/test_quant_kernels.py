"""Quantized-weight kernels (runtime/native/csrc/quant/) against numpy dequantize-then-matmul.

Every instruction set this CPU has is forced in turn, plus the scalar one. Tolerance: the
kernels round each activation to int8 per block of 32 (d = max|x_b| / 127), so an
activation moves by at most d / 2 = max|x_b| / 254; the output then moves by at most
sum_b (max|x_b| / 254) * sum_{i in b} |w_i| (``rounding_bound``), plus fp32 summation error.
A second check emulates the int8 scheme in numpy and must agree to fp32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.models.quant import KERNEL_QTYPES, X16_QTYPES, QuantizedWeight, quantize_dense
from kvserve.runtime import native
from kvserve.runtime.native import quant_ops

pytestmark = pytest.mark.skipif(
    not quant_ops.load(), reason=f"quantized kernels unavailable: {quant_ops.reason()}"
)
ISAS = quant_ops.supported_isas() if quant_ops.load() else []
# The formats of 32-value blocks (the K-quants: tests/runtime/test_kquant_kernels.py).
BLOCK32 = sorted(X16_QTYPES)


def test_kernels_load_and_scalar_is_always_there() -> None:
    assert quant_ops.build_dir().is_dir()
    assert quant_ops.build_dir().parent == native.build_dir().parent
    assert "scalar" in ISAS
    assert quant_ops.best_isa() == ISAS[0]


def rounding_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Largest |y - x @ w.T| that int8 activation rounding can cause. [M, N]"""
    m, k = x.shape
    amax = np.abs(x.reshape(m, k // 32, 32)).max(axis=2)  # [M, nb]
    wabs = np.abs(w.reshape(w.shape[0], k // 32, 32)).sum(axis=2)  # [N, nb]
    return (amax / 254.0) @ wabs.T


def emulate(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x quantized per block to int8 as the kernels do, times dense w, in float64. [M, N]"""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(blocks * inv), -127, 127)
    xq = (q * (amax / np.float32(127.0))).reshape(m, k)
    return xq.astype(np.float64) @ w.astype(np.float64).T


def reference(x: np.ndarray, weight: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """The gguf package's dequantized weight and x @ w.T in float64."""
    raw = weight.data.numpy().reshape(-1)
    w = gguf_quants.dequantize(raw, KERNEL_QTYPES[weight.qtype]).reshape(weight.shape)
    return w, x.astype(np.float64) @ w.astype(np.float64).T


def check(x: np.ndarray, weight: QuantizedWeight, y: np.ndarray) -> None:
    w, ref = reference(x, weight)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T  # [M, N]
    fp32_err = 1e-5 * scale + 1e-6
    err = np.abs(y.astype(np.float64) - ref)
    bound = rounding_bound(x, w)
    assert (err <= bound + fp32_err).all(), float((err - bound).max())
    assert (np.abs(y - emulate(x, w)) <= fp32_err).all()


@settings(max_examples=40, deadline=None)
@given(
    qtype=st.sampled_from(BLOCK32),
    m=st.integers(1, 64),
    n=st.integers(1, 70),
    k_blocks=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
    isa=st.sampled_from(ISAS or ["scalar"]),
)
def test_linear_matches_dequantized_reference(
    qtype: str, m: int, n: int, k_blocks: int, seed: int, isa: str
) -> None:
    rng = np.random.default_rng(seed)
    k = 32 * k_blocks
    weight = quantize_dense(torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)), qtype)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 10)).astype(np.float32)
    y = quant_ops.linear(torch.from_numpy(x), weight.data, qtype, isa=isa).numpy()
    check(x, weight, y)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", BLOCK32)
def test_every_isa_gives_the_same_result_on_decode_shapes(qtype: str, isa: str) -> None:
    """The embedded model's shapes (K = 576 and 1536, N odd and even) for M = 1, 5, 32."""
    rng = np.random.default_rng(1)
    for n, k in ((97, 576), (64, 1536)):
        weight = quantize_dense(torch.from_numpy(rng.standard_normal((n, k), np.float32)), qtype)
        for m in (1, 5, 32):
            x = rng.standard_normal((m, k), np.float32)
            y = quant_ops.linear(torch.from_numpy(x), weight.data, qtype, isa=isa).numpy()
            check(x, weight, y)
            scalar = quant_ops.linear(torch.from_numpy(x), weight.data, qtype, isa="scalar")
            np.testing.assert_allclose(y, scalar.numpy(), rtol=1e-5, atol=1e-4)


def test_bias_free_out_slice_and_bf16() -> None:
    """``out`` may be a column slice of a wider buffer (rows contiguous); bf16 in and out."""
    rng = np.random.default_rng(2)
    weight = quantize_dense(torch.from_numpy(rng.standard_normal((10, 64), np.float32)), "q4_1")
    x = torch.from_numpy(rng.standard_normal((3, 64), np.float32))
    wide = torch.full((3, 30), 7.0)
    quant_ops.linear(x, weight.data, "q4_1", out=wide[:, 5:15])
    full = quant_ops.linear(x, weight.data, "q4_1")
    torch.testing.assert_close(wide[:, 5:15], full, rtol=0, atol=0)
    assert (wide[:, :5] == 7).all() and (wide[:, 15:] == 7).all()
    y16 = quant_ops.linear(x.bfloat16(), weight.data, "q4_1")
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), full, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("qtype", BLOCK32)
def test_embedding_gathers_dequantized_rows(qtype: str) -> None:
    rng = np.random.default_rng(3)
    weight = quantize_dense(torch.from_numpy(rng.standard_normal((50, 96), np.float32)), qtype)
    ids = torch.tensor([0, 49, 7, 7], dtype=torch.long)
    out = torch.empty(4, 96)
    quant_ops.embedding(ids, weight.data, qtype, out)
    torch.testing.assert_close(out, weight.dequantize()[ids], rtol=0, atol=0)


def test_bad_input_is_rejected() -> None:
    weight = quantize_dense(torch.randn(8, 64), "q8_0")
    with pytest.raises(RuntimeError, match="row_bytes|bytes"):
        quant_ops.linear(torch.randn(2, 96), weight.data, "q8_0")
    with pytest.raises(RuntimeError, match="multiple of 32"):
        quant_ops.linear(torch.randn(2, 48), weight.data[:, :51].contiguous(), "q8_0")
    with pytest.raises(RuntimeError, match="out of range"):
        quant_ops.embedding(torch.tensor([8]), weight.data, "q8_0", torch.empty(1, 64))
    unsupported = [i for i in ("avx512_vnni", "avx_vnni", "avx2") if i not in ISAS]
    for isa in unsupported:
        with pytest.raises(RuntimeError, match="not supported"):
            quant_ops.linear(torch.randn(1, 64), weight.data, "q8_0", isa=isa)


def test_q4_1_block_layout_is_ggufs() -> None:
    """The weight bytes are GGUF's own blocks: the gguf package quantizes the same bytes."""
    w = np.random.default_rng(4).standard_normal((3, 64), np.float32)
    ours = quantize_dense(torch.from_numpy(w), "q4_1").data.numpy()
    theirs = gguf_quants.quantize(w, GGMLQuantizationType.Q4_1)
    np.testing.assert_array_equal(ours, theirs)


# ---- layout x16 (rows interleaved in groups of 16, kvserve/models/quant_layout.py) ----------

X16_ISAS = [i for i in ISAS if i in quant_ops.X16_ISAS]


@settings(max_examples=40, deadline=None)
@given(
    qtype=st.sampled_from(BLOCK32),
    m=st.integers(1, 64),
    n=st.integers(1, 70),
    k_blocks=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
    isa=st.sampled_from(X16_ISAS or ["scalar"]),
)
def test_x16_linear_matches_dequantized_reference(
    qtype: str, m: int, n: int, k_blocks: int, seed: int, isa: str
) -> None:
    """N odd and even, below and above 16 (plain tail rows after the groups)."""
    rng = np.random.default_rng(seed)
    k = 32 * k_blocks
    weight = quantize_dense(torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)), qtype)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 10)).astype(np.float32)
    x16 = weight.interleaved()
    y = quant_ops.linear(torch.from_numpy(x), x16.data, qtype, isa=isa, layout="x16").numpy()
    check(x, weight, y)


@pytest.mark.parametrize("qtype", BLOCK32)
def test_x16_equals_plain_on_decode_shapes(qtype: str) -> None:
    """Same integer dot products, same scale arithmetic order per block: the two layouts agree
    to fp32 summation order (K = 576, 1536; N = 97 leaves a tail of 1 row)."""
    rng = np.random.default_rng(5)
    for n, k in ((97, 576), (64, 1536)):
        weight = quantize_dense(torch.from_numpy(rng.standard_normal((n, k), np.float32)), qtype)
        x16 = weight.interleaved()
        for m in (1, 5, 32):
            x = torch.from_numpy(rng.standard_normal((m, k), np.float32))
            plain = quant_ops.linear(x, weight.data, qtype, isa="scalar")
            for isa in X16_ISAS:
                y = quant_ops.linear(x, x16.data, qtype, isa=isa, layout="x16")
                np.testing.assert_allclose(y.numpy(), plain.numpy(), rtol=1e-5, atol=1e-4)


@settings(max_examples=25, deadline=None)
@given(
    qtype=st.sampled_from(BLOCK32),
    m=st.integers(1, 40),
    n=st.integers(1, 70),
    seed=st.integers(0, 2**31 - 1),
    isa=st.sampled_from(X16_ISAS or ["scalar"]),
)
def test_x16_bf16_out_is_the_fp32_result_rounded(
    qtype: str, m: int, n: int, seed: int, isa: str
) -> None:
    """bf16 activations: the same int8 quantization as their fp32 values, so the bf16 output
    (with bias, into a column slice of a wider buffer) is the fp32 output + bias rounded to
    bf16, bit for bit, at every token count (the AVX-512 kernel's passes of 1-8 tokens and
    its vector store)."""
    rng = np.random.default_rng(seed)
    k = 64
    weight = quantize_dense(torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)), qtype)
    x16 = weight.interleaved()
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(torch.bfloat16)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    ref = quant_ops.linear(x.float(), x16.data, qtype, bias=bias, isa=isa, layout="x16")
    wide = torch.full((m, n + 7), 3.0, dtype=torch.bfloat16)
    quant_ops.linear(x, x16.data, qtype, bias=bias, out=wide[:, 3 : 3 + n], isa=isa, layout="x16")
    assert torch.equal(wide[:, 3 : 3 + n], ref.to(torch.bfloat16))
    assert torch.equal(wide[:, :3], torch.full((m, 3), 3.0, dtype=torch.bfloat16))
    assert torch.equal(wide[:, 3 + n :], torch.full((m, 4), 3.0, dtype=torch.bfloat16))


@pytest.mark.parametrize("qtype", BLOCK32)
def test_x16_byte_order_and_round_trip(qtype: str) -> None:
    """The documented order: per group and block, the 16 d (q4_1: then the 16 m), then the
    value bytes as [chunk][row][4 bytes]; ``plain()`` undoes it exactly."""
    rng = np.random.default_rng(6)
    weight = quantize_dense(torch.from_numpy(rng.standard_normal((35, 64), np.float32)), qtype)
    x16 = weight.interleaved()
    assert x16.layout == "x16" and x16.nbytes == weight.nbytes
    assert torch.equal(x16.plain().data, weight.data)
    plain, inter = weight.data.numpy(), x16.data.numpy()
    bb = plain.shape[1] // 2  # block bytes (2 blocks a row)
    scales = 2 if qtype == "q4_1" else 1
    group_block = inter[16:32].reshape(-1)[16 * bb : 32 * bb]  # group 1, block 1
    row = 16 + 3  # output row 19 = row 3 of group 1
    blk = plain[row, bb : 2 * bb]
    assert bytes(group_block[6:8]) == bytes(blk[0:2])  # its d
    if scales == 2:
        assert bytes(group_block[32 + 6 : 32 + 8]) == bytes(blk[2:4])  # its m
    values = group_block[32 * scales :].reshape(-1, 16, 4)  # [chunk, row, 4]
    np.testing.assert_array_equal(values[:, 3].reshape(-1), blk[2 * scales :])
    np.testing.assert_array_equal(inter[32:], plain[32:])  # the 3 tail rows stay plain
    torch.testing.assert_close(x16.dequantize(), weight.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", BLOCK32)
def test_x16_embedding_gathers_dequantized_rows(qtype: str) -> None:
    rng = np.random.default_rng(7)
    weight = quantize_dense(torch.from_numpy(rng.standard_normal((50, 96), np.float32)), qtype)
    ids = torch.tensor([0, 49, 17, 17, 33], dtype=torch.long)
    out = torch.empty(5, 96)
    quant_ops.embedding(ids, weight.interleaved().data, qtype, out, layout="x16")
    torch.testing.assert_close(out, weight.dequantize()[ids], rtol=0, atol=0)


# ---- amx_bf16_linear: x16 weights dequantized inside an AMX bf16 GEMM ----------------------

needs_amx_bf16 = pytest.mark.skipif(
    not (quant_ops.load() and quant_ops.amx_bf16_available()),
    reason="no AMX-BF16 here (CPU, build or tile state)",
)


@needs_amx_bf16
@settings(max_examples=40, deadline=None)
@given(
    qtype=st.sampled_from(BLOCK32),
    m=st.integers(1, 70),
    n=st.integers(1, 80),
    k_blocks=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
)
def test_amx_bf16_equals_the_dense_amx_copy_bit_for_bit(
    qtype: str, m: int, n: int, k_blocks: int, seed: int
) -> None:
    """Each weight dequantized as the dense copy is (d q + m in fp32, RNE to bf16), then the
    same tiles in the same k order: the outputs are the ``dequant_amx_bf16`` copy's exactly
    (N below, at and above 16 and 32: x16 groups, plain tail rows, half column groups)."""
    from kvserve.models.quant_linear import DequantAmxMethod

    rng = np.random.default_rng(seed)
    k = 32 * k_blocks
    weight = quantize_dense(torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)), qtype)
    x16 = weight.interleaved()
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(torch.bfloat16)
    dense = DequantAmxMethod(x16, torch.bfloat16)
    dense.prepare()
    assert torch.equal(quant_ops.amx_bf16_linear(x, x16.data, qtype), dense.apply(x))


@needs_amx_bf16
@pytest.mark.parametrize("qtype", BLOCK32)
@pytest.mark.parametrize("n", [96, 200, 208, 224])
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_bf16_pipelined_groups_equal_the_dense_copy(qtype: str, n: int, threads: int) -> None:
    """A thread dequantizes the next 32-column group between this one's tile products: many
    groups per thread, a last group that is half a group (N % 32 = 16: 208) or has plain tail
    rows (200), and M with one, two and three row pairs."""
    from kvserve.models.quant_linear import DequantAmxMethod

    gen = torch.Generator().manual_seed(n)
    x16 = quantize_dense(torch.randn(n, 96, generator=gen), qtype).interleaved()
    dense = DequantAmxMethod(x16, torch.bfloat16)
    dense.prepare()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 16, 33, 70):
            x = torch.randn(m, 96, generator=gen).to(torch.bfloat16)
            assert torch.equal(quant_ops.amx_bf16_linear(x, x16.data, qtype), dense.apply(x)), m
    finally:
        torch.set_num_threads(previous)


@needs_amx_bf16
def test_amx_bf16_writes_a_column_slice_and_reads_strided_rows() -> None:
    weight = quantize_dense(torch.randn(48, 64), "q4_1").interleaved()
    base = torch.randn(20, 80).to(torch.bfloat16)
    x = base[:, 8:72]  # rows 80 apart, not 64-byte aligned: copied before the tiles
    wide = torch.full((20, 100), 7.0, dtype=torch.bfloat16)
    quant_ops.amx_bf16_linear(x, weight.data, "q4_1", out=wide[:, 10:58])
    ref = quant_ops.amx_bf16_linear(x.contiguous(), weight.data, "q4_1")
    assert torch.equal(wide[:, 10:58], ref)
    assert (wide[:, :10] == 7).all() and (wide[:, 58:] == 7).all()


@needs_amx_bf16
def test_amx_bf16_bad_input_is_rejected_and_the_candidate_rules() -> None:
    from kvserve.models.quant_linear import QuantAmxBf16Method, quantized_candidates

    weight = quantize_dense(torch.randn(32, 64), "q8_0")
    with pytest.raises(RuntimeError, match="bfloat16"):
        quant_ops.amx_bf16_linear(torch.randn(2, 64), weight.interleaved().data, "q8_0")
    with pytest.raises(RuntimeError, match="out must be"):
        quant_ops.amx_bf16_linear(
            torch.randn(2, 64).to(torch.bfloat16),
            weight.interleaved().data,
            "q8_0",
            out=torch.empty(3, 32, dtype=torch.bfloat16),
        )
    with pytest.raises(ValueError, match="x16 layout only"):
        QuantAmxBf16Method(weight)
    cpu = torch.device("cpu")

    def names(w: QuantizedWeight, dtype: torch.dtype) -> list[str]:
        return [m.name for m in quantized_candidates(w, act_dtype=dtype, device=cpu)]

    assert "q8_0_x16_amx_bf16" in names(weight.interleaved(), torch.bfloat16)
    assert not any("amx_bf16" in x for x in names(weight.interleaved(), torch.float32))
    assert not any(x.endswith("_x16_amx_bf16") for x in names(weight, torch.bfloat16))


def test_x16_bad_input_is_rejected() -> None:
    weight = quantize_dense(torch.randn(32, 64), "q4_1").interleaved()
    if "avx_vnni" in ISAS:  # the one instruction set without an x16 kernel
        with pytest.raises(RuntimeError, match="x16 layout"):
            quant_ops.linear(torch.randn(1, 64), weight.data, "q4_1", isa="avx_vnni", layout="x16")
    with pytest.raises(RuntimeError, match="layout code"):
        torch.ops.kvserve_quant.linear(
            torch.empty(1, 32), torch.randn(1, 64), weight.data, 2, None, 0, 8
        )
    with pytest.raises(ValueError, match="plain layout"):
        weight.rows(0, 16)
    with pytest.raises(ValueError, match="unknown quantized layout"):
        QuantizedWeight("q4_1", weight.data, weight.shape, layout="x8")
