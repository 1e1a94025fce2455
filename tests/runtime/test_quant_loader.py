"""GGUF tensors kept quantized: a mixed-type file against its dequantized twin, the K-quant
repacks against the gguf package's dequantizers, and the bad-input errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from kvserve.models.errors import ModelLoadError
from kvserve.models.gguf_loader import load_gguf
from kvserve.models.loader import load_model
from kvserve.models.quant import QuantizedWeight, from_gguf, quantize_dense
from tests.tiny_gguf import make_tiny_gguf
from tests.tiny_models import make_tiny_model

Q = GGMLQuantizationType
# NOTE: K-quant rows hold super-blocks of 256 values: hidden and intermediate sizes must be
# multiples of 256 where a K-quant sits.
MIXED = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


def k_quant_bytes(shape: tuple[int, ...], qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """Random K-quant blocks with finite, small fp16 scales (gguf cannot quantize K-types)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1]))
    raw = rng.integers(0, 256, size=(rows * shape[-1] // block, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        raw[:, 0:2] = scales  # d
        raw[:, 2:4] = scales  # dmin
    else:  # Q6_K: d is the last field
        raw[:, -2:] = scales
    return raw.reshape(rows, -1)


def q8_0_error(amax: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """Largest Q8_0 round-trip error of a block with max |x| = amax: half a step (amax / 254)
    plus the fp16 rounding of the scale (2^-11 relative) times the largest level, 127."""
    return amax / 254 + amax * 2.0**-11 + 1e-7


@pytest.fixture
def sane_k_quants(monkeypatch: pytest.MonkeyPatch) -> None:
    """make_tiny_gguf writes K-quant tensors with finite scales."""
    original = gguf_quants.quantize

    def quantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
        if qtype in (Q.Q4_K, Q.Q6_K):
            return k_quant_bytes(data.shape, qtype, seed=data.shape[0])
        return original(data, qtype)

    monkeypatch.setattr(gguf_quants, "quantize", quantize)


def mixed_gguf(tmp_path: Path) -> str:
    """F32 norms, Q8_0 embedding, Q4_1 layers (Q8_0 v, Q4_K down in layer 0), Q6_K output."""
    types = {"token_embd.weight": "Q8_0", "output.weight": "Q6_K"}
    for layer in range(2):
        types[f"blk.{layer}.attn_v.weight"] = "Q8_0"
    types["blk.0.ffn_down.weight"] = "Q4_K"
    return make_tiny_gguf(tmp_path, "llama", tensor_type="Q4_1", tensor_types=types, **MIXED)


def test_mixed_gguf_loads_quantized_and_matches_its_dequantized_twin(
    tmp_path: Path, sane_k_quants: None
) -> None:
    path = mixed_gguf(tmp_path)
    arch, quant = load_gguf(path, torch.float32, "auto")
    _, dense = load_gguf(path, torch.float32, "none")
    assert quant.keys() == dense.keys()
    held = {name: (w.qtype, w.source_qtype) for name, w in quant.items() if hasattr(w, "qtype")}
    assert held["model.embed_tokens.weight"] == ("q8_0", "q8_0")
    assert held["lm_head.weight"] == ("q8_0", "q6_k")
    assert held["model.layers.0.mlp.down_proj.weight"] == ("q4_1", "q4_k")
    assert held["model.layers.1.mlp.down_proj.weight"] == ("q4_1", "q4_1")
    assert held["model.layers.1.self_attn.v_proj.weight"] == ("q8_0", "q8_0")
    assert isinstance(quant["model.norm.weight"], torch.Tensor)  # F32 norms stay dense
    for name, tensor in dense.items():
        got = quant[name]
        if isinstance(got, torch.Tensor):
            torch.testing.assert_close(got, tensor, rtol=0, atol=0)
            continue
        deq = got.dequantize()
        if got.source_qtype == "q6_k":  # re-quantized to Q8_0: half a step per block
            amax = tensor.reshape(-1, 32).abs().amax(dim=1, keepdim=True)
            assert ((deq - tensor).reshape(-1, 32).abs() <= q8_0_error(amax)).all()
        elif got.source_qtype == "q4_k":  # fp16 rounding of d * sc and dmin * m
            torch.testing.assert_close(deq, tensor, rtol=2e-3, atol=2e-3 * tensor.abs().max())
        else:  # kept as stored (q/k rows un-permuted as bytes): exact
            torch.testing.assert_close(deq, tensor, rtol=0, atol=0)
    assert arch.hidden_size == 256


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_k_quant_repack_matches_gguf_dequantize(qtype: GGMLQuantizationType) -> None:
    raw = k_quant_bytes((6, 512), qtype, seed=5).reshape(-1)
    ref = gguf_quants.dequantize(raw, qtype).reshape(6, 512)
    weight = from_gguf(raw, qtype, (6, 512))
    got = weight.dequantize().numpy()
    if qtype == Q.Q4_K:
        assert weight.qtype == "q4_1" and weight.nbytes == 6 * 16 * 20
        np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())
    else:
        assert weight.qtype == "q8_0" and weight.nbytes == 6 * 16 * 34
        amax = np.abs(ref.reshape(-1, 32)).max(axis=1, keepdims=True)
        assert (np.abs(got - ref).reshape(-1, 32) <= q8_0_error(amax)).all()


def test_concat_rows_and_shards() -> None:
    a = quantize_dense(torch.randn(4, 64), "q4_1")
    b = quantize_dense(torch.randn(3, 64), "q4_1")
    c = quantize_dense(torch.randn(3, 64), "q8_0")
    fused = QuantizedWeight.concat_rows([a, b])
    assert fused.shape == (7, 64) and fused.nbytes == a.nbytes + b.nbytes
    torch.testing.assert_close(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    torch.testing.assert_close(fused.rows(4, 7).dequantize(), b.dequantize())
    assert not QuantizedWeight.can_concat([a, c])
    with pytest.raises(ValueError, match="one qtype"):
        QuantizedWeight.concat_rows([a, c])


def test_hf_model_quantized_at_load(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "llama", tokenizer=False)
    dense = load_model(model_dir, "float32", "none").state_dict
    for qtype in ("q8_0", "q4_0", "q4_1"):
        quant = load_model(model_dir, "float32", qtype).state_dict
        w = quant["model.layers.0.mlp.up_proj.weight"]
        assert isinstance(w, QuantizedWeight) and w.qtype == qtype
        ref = dense["model.layers.0.mlp.up_proj.weight"]
        # Q4: 16 levels across each block's range; Q8: 255.
        step = (ref.reshape(-1, 32).amax(1) - ref.reshape(-1, 32).amin(1)).max()
        assert (w.dequantize() - ref).abs().max() <= step / (15 if qtype != "q8_0" else 127)
        assert isinstance(quant["model.norm.weight"], torch.Tensor)
    assert isinstance(
        load_model(model_dir, "float32", "auto").state_dict["model.layers.0.mlp.up_proj.weight"],
        torch.Tensor,
    )  # auto keeps an HF model dense


def test_unsupported_type_names_tensor_type_and_suggests_none(tmp_path: Path) -> None:
    path = make_tiny_gguf(
        tmp_path, "llama", tensor_type="Q4_1", tensor_types={"blk.1.ffn_up.weight": "Q5_0"}
    )
    with pytest.raises(ModelLoadError) as err:
        load_gguf(path, torch.float32, "auto")
    message = str(err.value)
    for part in (
        "blk.1.ffn_up.weight",
        "Q5_0",
        "Q8_0, Q4_0, Q4_1, Q4_K, Q6_K",
        "--quantization none",
    ):
        assert part in message
    load_gguf(path, torch.float32, "none")  # the dense path reads it


def test_size_mismatch_names_tensor(tmp_path: Path) -> None:
    raw = np.zeros(100, dtype=np.uint8)
    with pytest.raises(ModelLoadError, match=r"'w'.*Q4_1.*\[4, 64\].*160 bytes.*holds 100"):
        from_gguf(raw, Q.Q4_1, (4, 64), name="w", path="f.gguf")


def test_declared_type_larger_than_its_data_fails_at_read(tmp_path: Path) -> None:
    """A tensor whose header type needs more bytes than were written for it (Q4_1 data
    relabelled Q8_0) runs into the next tensor: the reader names it, its type and shape."""
    path = make_tiny_gguf(tmp_path, "llama", tensor_type="Q4_1")
    blob = bytearray(Path(path).read_bytes())
    name = b"blk.0.ffn_gate.weight"
    at = blob.index(name) + len(name)
    dims = int.from_bytes(blob[at : at + 4], "little")
    type_at = at + 4 + 8 * dims
    assert int.from_bytes(blob[type_at : type_at + 4], "little") == Q.Q4_1
    blob[type_at : type_at + 4] = int(Q.Q8_0).to_bytes(4, "little")
    Path(path).write_bytes(bytes(blob))
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_gate\.weight.*Q8_0.*does not match"):
        load_gguf(path, torch.float32, "auto")
