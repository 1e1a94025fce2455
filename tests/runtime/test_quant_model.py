"""The Llama model with quantized weights: the methods it runs, its output against the
dequantized twin, the fallback without the native kernels, and the bytes it holds."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from kvserve.engine.config import EngineConfig
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import load_model
from kvserve.models.quant import QuantizedWeight
from kvserve.models.quant_linear import (
    X16_AUTO_ISAS,
    DequantAmxMethod,
    DequantDenseMethod,
    DequantPrepackedMethod,
    DequantTileMethod,
    QuantAmxInt8Method,
    QuantizedParts,
    QuantKernelMethod,
    QuantSplitMethod,
    quantized_candidates,
)
from kvserve.models.quant_model import quantization_summary, quantized_nbytes, summary_line
from kvserve.runtime.amx_int8 import amx_int8_available
from kvserve.runtime.amx_linear import amx_available
from kvserve.runtime.attention.metadata import SeqSpec, build_attention_metadata
from kvserve.runtime.autotune.candidates import onednn_available, onednn_supports
from kvserve.runtime.native import quant_ops
from tests.tiny_gguf import make_tiny_gguf
from tests.tiny_models import make_tiny_model

CPU = torch.device("cpu")
NUM_TOKENS = 20


def build(path: str, quantization: str) -> LlamaForCausalLM:
    loaded = load_model(path, "float32", quantization)
    model = LlamaForCausalLM(loaded.arch)
    model.load_weights(loaded.state_dict)
    return model.eval()


def build_twin(path: str, quantization: str) -> LlamaForCausalLM:
    """The dense model of the quantized weights' exact values (dequantized at load)."""
    loaded = load_model(path, "float32", quantization)
    state_dict = {
        name: t.dequantize() if isinstance(t, QuantizedWeight) else t
        for name, t in loaded.state_dict.items()
    }
    model = LlamaForCausalLM(loaded.arch)
    model.load_weights(state_dict)
    return model.eval()


@torch.no_grad()
def logits(model: LlamaForCausalLM) -> torch.Tensor:
    """Logits of a 20-token prompt (one prefill chunk). [20, vocab]"""
    arch = model.arch
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (NUM_TOKENS,), generator=gen)
    caches = [
        torch.zeros(2, 4, 16, arch.num_key_value_heads, arch.head_dim)
        for _ in range(arch.num_hidden_layers)
    ]
    meta = build_attention_metadata(
        [SeqSpec(0, NUM_TOKENS, 0, [0, 1])], block_size=16, device=CPU, dtype=torch.float32
    )
    hidden = model(ids, torch.arange(NUM_TOKENS), caches, meta)
    return model.compute_logits(hidden)


def assert_close_to_twin(quant: torch.Tensor, dense: torch.Tensor) -> None:
    """int8 activations: each projection is off by ~1/254 of its inputs' block maxima; over
    two layers and the lm_head that stays within 3 % of the logits' range (measured 0.6-0.75 %
    on these tiny models, greedy agreement 95-100 %)."""
    assert torch.isfinite(quant).all()
    err = (quant - dense).abs().max()
    assert err <= 0.03 * dense.abs().max(), float(err)
    # and most greedy choices agree
    assert (quant.argmax(-1) == dense.argmax(-1)).float().mean() >= 0.8


@pytest.mark.skipif(not quant_ops.load(), reason="quantized kernels unavailable")
@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_runs_as_stored_and_matches_dequantized_twin(tmp_path: Path, tensor_type: str) -> None:
    path = make_tiny_gguf(tmp_path, "smollm", tensor_type=tensor_type)  # tied embedding
    quant, dense = build(path, "auto"), build(path, "none")
    qtype = tensor_type.lower()
    names = {lin.method_for(1).name for lin in quant.linears()}
    assert names == {kernel_name(qtype)}
    assert quant.quantized["lm_head"] is quant.quantized["embed_tokens"]
    # only norms stay as parameters; the blocks are counted once (tied table)
    params = sum(p.numel() for p in quant.parameters())
    assert params == (2 * quant.arch.num_hidden_layers + 1) * quant.arch.hidden_size
    blocks = sum(
        v.nbytes
        for v in load_model(path, "float32", "auto").state_dict.values()
        if isinstance(v, QuantizedWeight)
    )
    assert quantized_nbytes(quant) == blocks
    assert_close_to_twin(logits(quant), logits(dense))
    summary = quantization_summary(quant, "auto")
    assert summary["weight_bytes_by_format"][qtype] == blocks
    assert qtype in summary_line(summary)


def kernel_name(qtype: str) -> str:
    """The kernel method's name for a model weight: x16 layout where AVX-512 VNNI or AVX2 runs."""
    isa = quant_ops.best_isa()
    return f"{qtype}_x16_{isa}" if isa in X16_AUTO_ISAS else f"{qtype}_{isa}"


@pytest.mark.skipif(not quant_ops.load(), reason="quantized kernels unavailable")
def test_layout_x16_and_plain_give_the_same_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model's weights are repacked to the kernel's layout at load (x16 on AVX-512 VNNI);
    forcing either layout (``KVSERVE_QUANT_LAYOUT``) runs the same arithmetic."""
    from kvserve.models.quant_linear import LAYOUT_ENV, kernel_layout

    path = make_tiny_gguf(tmp_path, "smollm", tensor_type="Q4_1")
    auto = build(path, "auto")
    want = "x16" if quant_ops.best_isa() in X16_AUTO_ISAS else "plain"
    assert auto.quantized["lm_head"].layout == want
    assert {lay.quantized["gate_up"].layout for lay in auto.layers} == {want}
    layouts = {}
    for layout in ("plain", "x16"):
        monkeypatch.setenv(LAYOUT_ENV, layout)
        model = build(path, "auto")
        assert model.quantized["embed_tokens"].layout == layout
        layouts[layout] = logits(model)
    torch.testing.assert_close(layouts["plain"], layouts["x16"], rtol=1e-4, atol=1e-4)
    monkeypatch.setenv(LAYOUT_ENV, "x8")
    with pytest.raises(ValueError, match=LAYOUT_ENV):
        kernel_layout(auto.quantized["lm_head"])


@pytest.mark.skipif(not quant_ops.load(), reason="quantized kernels unavailable")
def test_mixed_formats_in_one_projection_run_split(tmp_path: Path) -> None:
    """q/k Q4_1 and v Q8_0: the fused qkv runs each part into its columns."""
    types = {f"blk.{i}.attn_v.weight": "Q8_0" for i in range(2)}
    path = make_tiny_gguf(tmp_path, "llama", tensor_type="Q4_1", tensor_types=types)
    quant, dense = build(path, "auto"), build(path, "none")
    layer = quant.layers[0]
    assert isinstance(layer.quantized["qkv"], QuantizedParts)
    assert isinstance(layer.quantized["gate_up"], QuantizedWeight)
    quant.ensure_linears()
    assert isinstance(layer.qkv_proj.method_for(1), QuantSplitMethod)
    assert_close_to_twin(logits(quant), logits(dense))


def test_without_native_kernels_weights_run_dequantized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No compiler: the candidates are only the dense copies, the embedding dequantizes rows in
    torch; the output equals the dense model's up to summation order."""
    monkeypatch.setattr(quant_ops, "_state", {"ok": False, "reason": "test"})
    path = make_tiny_gguf(tmp_path, "llama", tensor_type="Q4_1")
    quant, dense = build(path, "auto"), build(path, "none")
    assert {type(lin.method_for(1)) for lin in quant.linears()} == {DequantDenseMethod}
    torch.testing.assert_close(logits(quant), logits(dense), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not quant_ops.load(), reason="quantized kernels unavailable")
def test_candidates_kernel_first_then_dense_copy_with_its_cost() -> None:
    weight = QuantizedWeight.concat_rows(
        [quantize(torch.randn(8, 64)), quantize(torch.randn(4, 64))]
    )
    methods = quantized_candidates(weight, act_dtype=torch.bfloat16, device=CPU)
    want_types = [QuantKernelMethod, DequantTileMethod, DequantDenseMethod]
    if onednn_supports(torch.bfloat16):
        want_types.append(DequantPrepackedMethod)
    if amx_available():
        want_types.append(DequantAmxMethod)
    if amx_int8_available():
        want_types.append(QuantAmxInt8Method)
    assert [type(m) for m in methods] == want_types
    kernel, tile, dense = methods[:3]
    assert kernel.shares_source and kernel.nbytes == weight.nbytes
    assert tile.shares_source and tile.nbytes == weight.nbytes  # a scratch tile, no copy
    assert not dense.shares_source and dense.nbytes == 12 * 64 * 2  # bf16 copy
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(kernel.apply(x).float(), dense.apply(x).float(), rtol=0.05, atol=0.1)
    torch.testing.assert_close(tile.apply(x), dense.apply(x), rtol=0, atol=0)
    big = quantize(torch.randn(150, 4096))  # 9 tiles of 16 rows and a last one of 6
    xf = torch.randn(5, 4096)
    want = xf @ big.dequantize().t()
    for w in (big, big.interleaved()):  # x16: groups, then the plain tail rows
        tiled = DequantTileMethod(w, torch.float32)
        assert tiled.tile_rows == 16
        torch.testing.assert_close(tiled.apply(xf), want, rtol=1e-4, atol=1e-3)
    assert quantized_candidates(torch.randn(4, 64), act_dtype=torch.float32, device=CPU) == []


@pytest.mark.skipif(not onednn_available(), reason="oneDNN unavailable in torch")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_dense_copy_matches_the_dense_copy(dtype: torch.dtype) -> None:
    """``dequant_onednn_*``: the dense copy in oneDNN's layout, made on first use, with its
    memory counted; same product as ``dequant_*`` (bias included) up to summation order."""
    if not onednn_supports(dtype):
        # NOTE: torch's bf16 reorder raises there (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT);
        # the candidate lists leave it out (onednn_supports).
        pytest.skip(f"oneDNN has no {dtype} linear on this CPU")
    weight = quantize(torch.randn(48, 64))
    bias = torch.randn(48, dtype=dtype)
    packed = DequantPrepackedMethod(weight, dtype)
    dense = DequantDenseMethod(weight, dtype)
    for m in (packed, dense):
        m.bias = bias
    assert packed.name == f"dequant_onednn_{'fp32' if dtype == torch.float32 else 'bf16'}"
    assert packed.packed is None  # nothing copied until it runs
    assert not packed.shares_source and packed.nbytes == 48 * 64 * dtype.itemsize
    assert packed.shape_cached and packed.allocates
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.1}
    for rows in (1, 8, 33):
        x = torch.randn(rows, 64, dtype=dtype)
        out = torch.empty(rows, 48, dtype=dtype)
        got = packed.apply(x, out)
        assert got.data_ptr() == out.data_ptr()
        torch.testing.assert_close(got.float(), dense.apply(x).float(), **tol)
    assert packed.packed is not None


def test_a_linear_makes_its_dense_copies_when_built() -> None:
    """A chosen copy is made when the ``Linear`` is built, not by the first request."""
    from kvserve.runtime.autotune.candidates import build_linear
    from kvserve.runtime.linear import M_MAX

    weight = quantize(torch.randn(16, 64))
    names = ["dequant_fp32"] + (["dequant_onednn_fp32"] if onednn_available() else [])
    for name in names:
        lin = build_linear(weight, act_dtype=torch.float32, device=CPU, choice=[(M_MAX, name)])
        (method,) = lin.methods()
        assert method.name == name
        held = method.weight_t if isinstance(method, DequantDenseMethod) else method.packed
        assert held is not None


def quantize(w: torch.Tensor) -> QuantizedWeight:
    from kvserve.models.quant import quantize_dense

    return quantize_dense(w, "q4_1")


@pytest.mark.skipif(not quant_ops.load(), reason="quantized kernels unavailable")
@pytest.mark.parametrize("qtype", ["q8_0", "q4_1"])
def test_hf_model_quantized_at_load_runs(tmp_path: Path, qtype: str) -> None:
    model_dir = make_tiny_model(tmp_path, "qwen2", tokenizer=False)  # with q/k/v biases
    quant, dense = build(model_dir, qtype), build_twin(model_dir, qtype)
    assert quant.layers[0].qkv_bias is not None
    assert_close_to_twin(logits(quant), logits(dense))


def test_quantization_flag() -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli_args(parser.parse_args(["--quantization", "q4_0"]))
    assert config.quantization == "q4_0"
    # NOTE: the default runs a GGUF as stored (DESIGN.md's interface; vLLM runs a checkpoint
    # in its own quantization unless told otherwise).
    assert EngineConfig().quantization == "auto"
    assert EngineConfig.from_cli_args(parser.parse_args([])).quantization == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "q5_k"])
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(quantization="q4_1", device="cuda")
    # auto means dense weights off the CPU (engine_startup), so it is accepted there.
    assert EngineConfig(quantization="auto", device="cuda").quantization == "auto"


def test_accuracy_bench_weights_setting() -> None:
    from kvserve.bench.accuracy import parse_setting

    setting = parse_setting("weights-auto")
    assert setting.engine_kwargs()["quantization"] == "auto"
    assert setting.kv_cache_dtype == "auto"
    assert parse_setting("int8").engine_kwargs()["quantization"] == "none"
    both = parse_setting("bf16-weights-auto")
    assert (both.name, both.dtype, both.quantization) == ("bf16-weights-auto", "bfloat16", "auto")
    with pytest.raises(ValueError, match="unknown weights setting"):
        parse_setting("weights-q5_k")
    with pytest.raises(ValueError, match="unknown weights setting"):
        parse_setting("bf16-weights-q5_k")


@pytest.mark.skipif(not quant_ops.load(), reason="quantized kernels unavailable")
def test_dense_copies_of_quantized_weights_are_reported(tmp_path: Path) -> None:
    """A plan that takes the dense copy for prefill (M > 128) states its memory cost."""
    from kvserve.models.quant_select import quantized_shapes
    from kvserve.runtime.autotune.candidates import m_buckets

    path = make_tiny_gguf(tmp_path, "smollm", tensor_type="Q4_1")
    model = build(path, "auto")
    assert quantization_summary(model, "auto")["dense_copy_bytes"] == 0
    shapes = quantized_shapes(model)
    bounds = [b for b, _ in m_buckets()]
    plan = {
        s: [(b, "dequant_fp32" if b == bounds[-1] else kernel_name("q4_1")) for b in bounds]
        for s in shapes
    }
    model.set_linear_plan(plan)
    want = sum(
        lin.out_features * lin.in_features * 4
        for lin in model.linears()
        if (lin.out_features, lin.in_features) in shapes
    )
    summary = quantization_summary(model, "auto")
    assert summary["dense_copy_bytes"] == want > 0
    assert "dense copies of quantized weights" in summary_line(summary)
    assert summary["layouts"] == {
        "x16" if quant_ops.best_isa() in X16_AUTO_ISAS else "plain": quantized_nbytes(model)
    }
