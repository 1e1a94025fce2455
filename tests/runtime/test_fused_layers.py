"""Every decoder layer in one native call (``kvserve/models/fused_layers.py``): the same
logits bit for bit as the layer-by-layer path, on the steps it takes, and the steps it
leaves to that path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.models import fused_layers
from kvserve.models.decoder_layer import LINEAR_VERSIONS
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import load_model
from kvserve.models.quant_linear import (
    DequantAmxMethod,
    DequantDenseMethod,
    DequantPrepackedMethod,
    QuantAmxBf16Method,
    QuantAmxInt8Method,
    QuantSplitMethod,
)
from kvserve.runtime import native
from kvserve.runtime.amx_int8 import amx_int8_available
from kvserve.runtime.amx_linear import AmxBf16Method, amx_available
from kvserve.runtime.attention.metadata import SeqSpec, build_attention_metadata
from kvserve.runtime.attention.native_cpu import NativeCPUBackend
from kvserve.runtime.autotune.candidates import onednn_available, onednn_supports
from kvserve.runtime.linear import (
    EXACT_ROWS,
    M_MAX,
    DenseMmMethod,
    Linear,
    OneDnnPrepackedMethod,
)
from kvserve.runtime.native import quant_ops
from tests.tiny_gguf import make_tiny_gguf

pytestmark = pytest.mark.skipif(
    not (native.load() and quant_ops.load()), reason="native kernels unavailable"
)

CPU = torch.device("cpu")
BLOCK = 4
PROMPTS = (7, 5, 9)  # three sequences; blocks of 4 tokens, so each spans several blocks


def build(path: str, quantization: str, dtype: torch.dtype) -> LlamaForCausalLM:
    loaded = load_model(path, "float32", quantization)
    model = LlamaForCausalLM(loaded.arch, attn_backend="native")
    model.load_weights(loaded.state_dict)
    return model.to(dtype).eval()


def steps() -> list[tuple[int, list[SeqSpec]]]:
    """(rows, seqs) of a step schedule: all prompts as chunks, two decode steps, then the
    decodes of sequences 0 and 1 with four new tokens of sequence 2 (a mixed step)."""
    tables = [[4 * i + j for j in range(4)] for i in range(len(PROMPTS))]
    out = []
    offsets = [sum(PROMPTS[:i]) for i in range(len(PROMPTS))]
    out.append(
        (sum(PROMPTS), [SeqSpec(offsets[i], n, 0, tables[i]) for i, n in enumerate(PROMPTS)])
    )
    lens = list(PROMPTS)
    for _ in range(2):
        out.append((3, [SeqSpec(i, 1, lens[i], tables[i]) for i in range(3)]))
        lens = [n + 1 for n in lens]
    mixed = [SeqSpec(i, 1, lens[i], tables[i]) for i in range(2)]
    out.append((6, [*mixed, SeqSpec(2, 4, lens[2], tables[2])]))
    return out


@torch.no_grad()
def run(model: LlamaForCausalLM, dtype: torch.dtype, *, fused: bool) -> list[torch.Tensor]:
    """Logits [rows, vocab] of every step of ``steps`` from empty caches."""
    model.fused_layers = fused
    arch = model.arch
    gen = torch.Generator().manual_seed(0)
    caches = [
        torch.zeros(2, 16, BLOCK, arch.num_key_value_heads, arch.head_dim, dtype=dtype)
        for _ in range(arch.num_hidden_layers)
    ]
    logits = []
    for rows, seqs in steps():
        meta = build_attention_metadata(seqs, block_size=BLOCK, device=CPU, dtype=dtype)
        ids = torch.randint(0, arch.vocab_size, (rows,), generator=gen)
        positions = torch.cat([torch.arange(s.start_pos, s.seq_len) for s in seqs])  # [rows]
        logits.append(model.compute_logits(model(ids, positions, caches, meta)))
    return logits


def fused_rows(model: LlamaForCausalLM) -> set[int]:
    """The step row counts for which the fused call has arguments."""
    return {rows for rows, (_, args) in model.fused_cache.items() if args is not None}


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_steps_equal_layer_by_layer_bitwise(
    tmp_path: Path, tensor_type: str, dtype: torch.dtype
) -> None:
    path = make_tiny_gguf(tmp_path, "smollm", tensor_type=tensor_type)
    model = build(path, "auto", dtype)
    backend = model.attn_backend
    assert isinstance(backend, NativeCPUBackend)
    backend.chunk_kernel_max_tokens = 0  # prompts through SDPA: those steps run layer by layer
    ref = run(model, dtype, fused=False)
    assert model.fused_cache == {}
    got = run(model, dtype, fused=True)
    assert fused_rows(model) == {3}  # the decode-only steps; the others have a chunk on SDPA
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    # Chunks through the decode kernel: the prompts' step and the mixed step fuse too.
    backend.chunk_kernel_max_tokens = 16
    ref = run(model, dtype, fused=False)
    got = run(model, dtype, fused=True)
    assert fused_rows(model) == {sum(PROMPTS), 3, 6}
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)


def test_mixed_formats_fuse_as_parts(tmp_path: Path) -> None:
    """q/k Q4_1 and v Q8_0 in one fused qkv weight (a K-quant GGUF's usual mix): each part
    writes its columns, as ``QuantSplitMethod`` does, bit for bit."""
    types = {f"blk.{i}.attn_v.weight": "Q8_0" for i in range(2)}
    path = make_tiny_gguf(tmp_path, "llama", tensor_type="Q4_1", tensor_types=types)
    model = build(path, "auto", torch.float32)
    model.ensure_linears()
    assert isinstance(model.layers[0].qkv_proj.method_for(3), QuantSplitMethod)
    ref = run(model, torch.float32, fused=False)
    got = run(model, torch.float32, fused=True)
    assert fused_rows(model) == {3}
    assert model.fused_cache[3][1].part_counts[:4] == [3, 1, 1, 1]  # q, k, v
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not quant_ops.amx_bf16_available(), reason="needs AMX-BF16")
def test_amx_bf16_projections_fuse(tmp_path: Path) -> None:
    """Projections on ``QuantAmxBf16Method`` (the selection's choice from ~16 rows on AMX
    CPUs) run in the fused call too, bit for bit."""
    model = build(make_tiny_gguf(tmp_path, "smollm", tensor_type="Q4_1"), "auto", torch.bfloat16)
    model.ensure_linears()
    for layer in model.layers:
        for name in fused_layers.PROJECTIONS:
            method = QuantAmxBf16Method(getattr(layer, name).method_for(1).weight)
            setattr(layer, name, Linear(method.weight, [(M_MAX, method)]))
        layer.linears_version = next(LINEAR_VERSIONS)
    ref = run(model, torch.bfloat16, fused=False)
    got = run(model, torch.bfloat16, fused=True)
    assert fused_rows(model) == {3}
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not amx_int8_available(), reason="needs AMX-INT8")
def test_amx_int8_projections_fuse(tmp_path: Path) -> None:
    """Projections on ``QuantAmxInt8Method`` (an int8 copy the selection takes from ~16 rows
    where it measures faster) run in the fused call too, bit for bit."""
    model = build(make_tiny_gguf(tmp_path, "smollm", tensor_type="Q4_1"), "auto", torch.bfloat16)
    model.ensure_linears()
    for layer in model.layers:
        for name in fused_layers.PROJECTIONS:
            source = getattr(layer, name).method_for(1).weight
            method = QuantAmxInt8Method(source)
            setattr(layer, name, Linear(source, [(M_MAX, method)]))
        layer.linears_version = next(LINEAR_VERSIONS)
    ref = run(model, torch.bfloat16, fused=False)
    got = run(model, torch.bfloat16, fused=True)
    assert fused_rows(model) == {3}
    assert fused_layers.PART_AMX_INT8 in model.fused_cache[3][1].parts[::6]
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not amx_available(), reason="needs AMX-BF16")
def test_amx_dense_projections_fuse(tmp_path: Path) -> None:
    """A dense bf16 model's projections on ``AmxBf16Method`` (its choice on AMX CPUs) run in
    the fused call too, bit for bit."""
    model = build(make_tiny_gguf(tmp_path, "smollm", tensor_type="F32"), "none", torch.bfloat16)
    model.ensure_linears()
    for layer in model.layers:
        for name in fused_layers.PROJECTIONS:
            weight = getattr(layer, name).method_for(1).weight
            setattr(layer, name, Linear(weight, [(M_MAX, AmxBf16Method(weight))]))
        layer.linears_version = next(LINEAR_VERSIONS)
    ref = run(model, torch.bfloat16, fused=False)
    got = run(model, torch.bfloat16, fused=True)
    assert fused_rows(model) == {3}
    assert set(model.fused_cache[3][1].parts[::6]) == {fused_layers.PART_AMX_DENSE}
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)


COPIES = {  # a dense copy of a quantized weight -> the part kind it runs as
    DequantDenseMethod: fused_layers.PART_MM,
    DequantPrepackedMethod: fused_layers.PART_ONEDNN,
    DequantAmxMethod: fused_layers.PART_AMX_DENSE,
}


@pytest.mark.parametrize("copy", list(COPIES), ids=lambda c: c.__name__)
def test_dense_copies_of_quantized_weights_fuse(tmp_path: Path, copy: type) -> None:
    """Projections on a dense copy of a quantized weight (the selection's choice for some
    shapes at 17-32 rows on the AMX Xeon) run in the fused call as the dense method the copy
    holds, beside the int8-dot kernel on the blocks, bit for bit."""
    if copy is DequantAmxMethod and not amx_available():
        pytest.skip("needs AMX-BF16")
    if copy is DequantPrepackedMethod and not (
        onednn_available() and onednn_supports(torch.bfloat16)
    ):
        pytest.skip("needs oneDNN with bf16")
    model = build(make_tiny_gguf(tmp_path, "smollm", tensor_type="Q4_1"), "auto", torch.bfloat16)
    model.ensure_linears()
    for layer in model.layers:
        for name in ("qkv_proj", "down_proj"):  # o and gate/up stay on the int8-dot kernel
            source = getattr(layer, name).method_for(1).weight
            setattr(layer, name, Linear(source, [(M_MAX, copy(source, torch.bfloat16))]))
        layer.linears_version = next(LINEAR_VERSIONS)
    ref = run(model, torch.bfloat16, fused=False)
    got = run(model, torch.bfloat16, fused=True)
    assert fused_rows(model) == {3}
    assert set(model.fused_cache[3][1].parts[::6]) == {fused_layers.PART_INT8_DOT, COPIES[copy]}
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_models_fuse_on_mm_and_onednn(tmp_path: Path, dtype: torch.dtype) -> None:
    """A dense model's projections on ``torch.mm`` (the default without a plan) and on oneDNN
    with prepacked weights run in the fused call too, bit for bit."""
    model = build(make_tiny_gguf(tmp_path, "smollm", tensor_type="F32"), "none", dtype)
    model.ensure_linears()
    assert isinstance(model.layers[0].qkv_proj.method_for(3), DenseMmMethod)
    ref = run(model, dtype, fused=False)
    got = run(model, dtype, fused=True)
    assert fused_rows(model) == {3}
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    if not (onednn_available() and onednn_supports(dtype)):
        return
    for layer in model.layers:
        for name in fused_layers.PROJECTIONS:
            weight = getattr(layer, name).method_for(1).weight
            setattr(layer, name, Linear(weight, [(M_MAX, OneDnnPrepackedMethod(weight))]))
        layer.linears_version = next(LINEAR_VERSIONS)
    ref = run(model, dtype, fused=False)
    got = run(model, dtype, fused=True)
    assert fused_rows(model) == {3}
    assert model.fused_cache[3][1].parts[0] == fused_layers.PART_ONEDNN
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)


def test_steps_it_leaves_to_the_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A projection with a bias (qwen2's qkv), a method the call does not run (rows a
    shape-cached kernel would pad), the torch layer ops and the environment switch each keep
    every step layer by layer."""
    qwen = build(make_tiny_gguf(tmp_path, "qwen2", tensor_type="Q8_0"), "auto", torch.float32)
    run(qwen, torch.float32, fused=True)
    assert fused_rows(qwen) == set() and qwen.fused_cache  # remembered as "cannot fuse"
    dense = build(make_tiny_gguf(tmp_path, "smollm", tensor_type="F32"), "none", torch.bfloat16)
    dense.ensure_linears()
    padded = EXACT_ROWS + 1  # bf16 torch.mm caches a oneDNN primitive per row count
    assert fused_layers.build_fused_layers(list(dense.layers), padded) is None
    assert fused_layers.build_fused_layers(list(dense.layers), EXACT_ROWS) is not None
    model = build(make_tiny_gguf(tmp_path, "smollm", tensor_type="Q8_0"), "auto", torch.float32)
    model.set_native_ops(False)
    run(model, torch.float32, fused=True)
    assert model.fused_cache == {}
    monkeypatch.setenv(fused_layers.DISABLE_ENV, "0")
    assert not fused_layers.enabled_by_env()
    off = build(make_tiny_gguf(tmp_path, "smollm", tensor_type="Q8_0"), "auto", torch.float32)
    assert off.fused_layers is False


def test_rebuilt_projections_are_taken_up(tmp_path: Path) -> None:
    """The arguments are remade when the projections are rebuilt (a new plan, a dtype move):
    the fused call never reads a stale weight or norm."""
    model = build(make_tiny_gguf(tmp_path, "smollm", tensor_type="Q4_1"), "auto", torch.float32)
    run(model, torch.float32, fused=True)
    before = model.fused_cache[3][0]
    model.fused_cache[99] = (before, None)  # another row count, built before the rebuild
    model.set_linear_plan(None)
    run(model, torch.float32, fused=True)
    assert model.fused_cache[3][0] != before and fused_rows(model) == {3}
    assert 99 not in model.fused_cache  # stale entries go with the first stale one found
    model.to(torch.bfloat16)
    got = run(model, torch.bfloat16, fused=True)
    ref = run(model, torch.bfloat16, fused=False)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)


def call_with(weights: list[torch.Tensor], parts: list[int], counts: list[int]) -> None:
    """``decode_layers`` on a one-layer shape with these projection arguments."""
    torch.ops.kvserve.decode_layers(
        *[torch.zeros(1, 8)] * 4,  # hidden, residual, cos, sin
        [torch.zeros(8)],
        [torch.zeros(8)],
        weights,
        parts,
        counts,
        [torch.zeros(2, 1, 4, 1, 8)],
        torch.zeros(1, dtype=torch.long),
        torch.zeros(1, 1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
        1,
        1e-5,
        1.0,
        0,
        0,
        torch.zeros(1, 8),
        torch.zeros(1, 24),
        *[torch.zeros(1, 8)] * 3,
    )


def test_bad_arguments_name_what_is_wrong() -> None:
    with pytest.raises(RuntimeError, match="four projections per layer"):
        call_with([], [], [])
    with pytest.raises(RuntimeError, match="at least one part"):
        call_with([], [], [0, 1, 1, 1])
    with pytest.raises(RuntimeError, match="6 codes per weight"):
        call_with([torch.zeros(8, 20, dtype=torch.uint8)] * 4, [0] * 6, [1] * 4)
    weight = torch.zeros(8, 10, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="unknown part kind 7"):
        call_with([weight] * 4, [7, 1, 4, 0, 0, 8] * 4, [1] * 4)


def test_gemma_layers_run_one_by_one(tmp_path: Path) -> None:
    """Gemma's layers (norms of the attention and MLP outputs, GeGLU) are not what the
    native call runs: a Gemma 2 step whose every layer reads the step's metadata as is (no
    window inside the context, the default scale, no soft caps) still runs layer by layer,
    with the same logits."""
    path = make_tiny_gguf(
        tmp_path,
        "gemma2",
        tensor_type="Q8_0",
        sliding_window=4096,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
    )
    model = build(path, "auto", torch.float32)
    assert model.arch.shared_window is None and model.attention_scale is None
    ref = run(model, torch.float32, fused=False)
    got = run(model, torch.float32, fused=True)
    assert fused_rows(model) == set() and model.fused_cache  # asked, and refused
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
