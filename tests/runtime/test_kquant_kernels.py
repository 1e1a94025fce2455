"""The K-quant kernels (csrc/quant/quant_q4_k.cpp, quant_q5_k.cpp, quant_q6_k.cpp) on the
blocks as GGUF stores them, against the gguf package's dequantized weight.

The same bound as the other formats (tests/runtime/test_quant_kernels.py, ``check``): the
activations are rounded to int8 per block of 32, so the output may move by at most
``rounding_bound`` plus fp32 summation error. Weights come two ways: the reference quantizer
(``kvserve.models.kquant_ref``) and random bytes with finite scales (every bit pattern of the
6-bit scales and mins, negative Q6_K scales), so the kernels are checked against gguf's
reading of the layout, not against our writer. Every instruction set this CPU has, and scalar.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import quants as gguf_quants

from kvserve.models.kquant_ref import quantize_kquant
from kvserve.models.quant import (
    KERNEL_QTYPES,
    KQUANT_QTYPES,
    QuantizedWeight,
    bits_per_weight,
    quantize_dense,
)
from kvserve.models.quant_linear import kernel_layout
from kvserve.runtime.native import quant_ops
from tests.runtime.test_quant_kernels import ISAS, check

pytestmark = pytest.mark.skipif(
    not quant_ops.load(), reason=f"quantized kernels unavailable: {quant_ops.reason()}"
)


def random_blocks(qtype: str, n: int, k: int, seed: int) -> QuantizedWeight:
    """Random bytes as ``qtype`` blocks, the fp16 super-block scales set small and finite."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[KERNEL_QTYPES[qtype]]
    raw = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, size=(raw.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == "q6_k":
        raw[:, -2:] = scales[:, :2]  # d is the last field
    else:
        raw[:, 0:4] = scales  # d, dmin
    return QuantizedWeight(qtype, torch.from_numpy(raw.reshape(n, -1)), (n, k))


def weights(qtype: str, n: int, k: int, seed: int) -> list[QuantizedWeight]:
    rng = np.random.default_rng(seed)
    dense = torch.from_numpy(rng.standard_normal((n, k), np.float32))
    return [quantize_dense(dense, qtype), random_blocks(qtype, n, k, seed)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", KQUANT_QTYPES)
def test_linear_matches_dequantized_reference(qtype: str, isa: str) -> None:
    """Odd and even row counts (tiles of 4 and the rest), M across the 4-token tiles."""
    rng = np.random.default_rng(7)
    for n, k in ((13, 512), (8, 1536)):
        for weight in weights(qtype, n, k, seed=n):
            for m in (1, 2, 5, 9):
                x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10)).astype(np.float32)
                y = quant_ops.linear(torch.from_numpy(x), weight.data, qtype, isa=isa).numpy()
                check(x, weight, y)
                scalar = quant_ops.linear(torch.from_numpy(x), weight.data, qtype, isa="scalar")
                scalar = scalar.numpy()  # the same integer dots, summed in another order
                np.testing.assert_allclose(y, scalar, rtol=1e-5, atol=1e-5 * np.abs(scalar).max())


@pytest.mark.parametrize("qtype", KQUANT_QTYPES)
def test_a_token_does_not_change_with_its_batch(qtype: str) -> None:
    """Row t of an M-row call equals the same token alone, bit for bit (batch invariance)."""
    rng = np.random.default_rng(8)
    weight = random_blocks(qtype, 9, 512, seed=3)
    x = torch.from_numpy(rng.standard_normal((7, 512), np.float32))
    whole = quant_ops.linear(x, weight.data, qtype)
    for t in range(7):
        alone = quant_ops.linear(x[t : t + 1].clone(), weight.data, qtype)
        torch.testing.assert_close(whole[t : t + 1], alone, rtol=0, atol=0)


@pytest.mark.parametrize("qtype", KQUANT_QTYPES)
def test_bf16_activations_and_an_out_slice(qtype: str) -> None:
    rng = np.random.default_rng(9)
    weight = random_blocks(qtype, 6, 256, seed=4)
    x = torch.from_numpy(rng.standard_normal((3, 256), np.float32))
    wide = torch.full((3, 10), 7.0)
    quant_ops.linear(x, weight.data, qtype, out=wide[:, 2:8])
    full = quant_ops.linear(x, weight.data, qtype)
    torch.testing.assert_close(wide[:, 2:8], full, rtol=0, atol=0)
    assert (wide[:, :2] == 7).all() and (wide[:, 8:] == 7).all()
    y16 = quant_ops.linear(x.bfloat16(), weight.data, qtype)
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), full, rtol=2e-2, atol=2e-2 * full.abs().max().item())


@pytest.mark.parametrize("qtype", KQUANT_QTYPES)
def test_embedding_and_dequantize_equal_gguf_exactly(qtype: str) -> None:
    weight = random_blocks(qtype, 20, 512, seed=5)
    ref = gguf_quants.dequantize(weight.data.numpy().reshape(-1), KERNEL_QTYPES[qtype])
    ref = torch.from_numpy(ref.reshape(20, 512))
    torch.testing.assert_close(weight.dequantize(), ref, rtol=0, atol=0)
    ids = torch.tensor([0, 19, 7, 7], dtype=torch.long)
    out = torch.empty(4, 512)
    quant_ops.embedding(ids, weight.data, qtype, out)
    torch.testing.assert_close(out, ref[ids], rtol=0, atol=0)
    out16 = torch.empty(4, 512, dtype=torch.bfloat16)
    quant_ops.embedding(ids, weight.data, qtype, out16)
    torch.testing.assert_close(out16, ref[ids].bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize(("qtype", "levels"), [("q4_k", 15), ("q5_k", 31), ("q6_k", 62)])
def test_reference_quantizer_writes_the_gguf_layout(qtype: str, levels: int) -> None:
    """gguf reads back what kquant_ref wrote within a step (plus the 6-bit scales' rounding)."""
    rng = np.random.default_rng(10)
    dense = rng.standard_normal((4, 512)).astype(np.float32)
    raw = quantize_kquant(dense, KERNEL_QTYPES[qtype])
    assert raw.nbytes * 8 / dense.size == bits_per_weight(qtype)
    back = gguf_quants.dequantize(raw, KERNEL_QTYPES[qtype]).reshape(dense.shape)
    spread = dense.reshape(4, -1, 32).max(axis=2) - np.minimum(dense.reshape(4, -1, 32).min(2), 0)
    step = spread.max() / levels
    assert np.abs(back - dense).max() <= 1.1 * step


def test_bits_per_weight_are_the_files() -> None:
    assert bits_per_weight("q4_k") == 4.5
    assert bits_per_weight("q5_k") == 5.5
    assert bits_per_weight("q6_k") == 6.5625


def test_bad_input_is_rejected() -> None:
    weight = random_blocks("q4_k", 4, 512, seed=6)
    with pytest.raises(RuntimeError, match="bytes"):
        quant_ops.linear(torch.randn(2, 256), weight.data, "q4_k")
    with pytest.raises(RuntimeError, match="multiple of 256"):
        quant_ops.linear(torch.randn(2, 96), weight.data[:, :54].contiguous(), "q4_k")
    with pytest.raises(RuntimeError, match="no x16 layout"):
        quant_ops.linear(torch.randn(2, 512), weight.data, "q4_k", layout="x16")
    with pytest.raises(ValueError, match="no x16 layout"):
        weight.interleaved()
    with pytest.raises(ValueError, match="multiple of the q6_k block size 256"):
        QuantizedWeight("q6_k", torch.zeros(2, 105, dtype=torch.uint8), (2, 128))
    with pytest.raises(ValueError, match="multiple of 256 values"):
        quantize_dense(torch.randn(2, 96), "q5_k")
    assert kernel_layout(weight, "x16") is weight  # stays plain
