"""GGUF tensors kept quantized: a mixed-type file against its dequantized twin, K-quant
tensors held as the file's bytes, and the bad-input errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from kvserve.models.errors import ModelLoadError
from kvserve.models.gguf_loader import hf_name, load_gguf
from kvserve.models.gguf_reader import read_gguf
from kvserve.models.loader import load_model
from kvserve.models.quant import QuantizedWeight, bits_per_weight, from_gguf, quantize_dense
from tests.tiny_gguf import make_tiny_gguf
from tests.tiny_models import make_tiny_model

Q = GGMLQuantizationType
# NOTE: K-quant rows hold super-blocks of 256 values: hidden and intermediate sizes must be
# multiples of 256 where a K-quant sits.
MIXED = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


def mixed_gguf(tmp_path: Path) -> str:
    """F32 norms, Q8_0 embedding, Q4_1 layers (Q8_0 v; Q4_K down, Q5_K up in layer 0), Q6_K
    output: the mix of llama.cpp's Q4_K_M and older files."""
    types = {"token_embd.weight": "Q8_0", "output.weight": "Q6_K"}
    for layer in range(2):
        types[f"blk.{layer}.attn_v.weight"] = "Q8_0"
    types["blk.0.ffn_down.weight"] = "Q4_K"
    types["blk.0.ffn_up.weight"] = "Q5_K"
    return make_tiny_gguf(tmp_path, "llama", tensor_type="Q4_1", tensor_types=types, **MIXED)


def test_mixed_gguf_loads_quantized_and_matches_its_dequantized_twin(tmp_path: Path) -> None:
    path = mixed_gguf(tmp_path)
    arch, quant = load_gguf(path, torch.float32, "auto")
    _, dense = load_gguf(path, torch.float32, "none")
    assert quant.keys() == dense.keys()
    held = {name: w.qtype for name, w in quant.items() if hasattr(w, "qtype")}
    assert held["model.embed_tokens.weight"] == "q8_0"
    assert held["lm_head.weight"] == "q6_k"
    assert held["model.layers.0.mlp.down_proj.weight"] == "q4_k"
    assert held["model.layers.0.mlp.up_proj.weight"] == "q5_k"
    assert held["model.layers.1.mlp.down_proj.weight"] == "q4_1"
    assert held["model.layers.1.self_attn.v_proj.weight"] == "q8_0"
    assert isinstance(quant["model.norm.weight"], torch.Tensor)  # F32 norms stay dense
    for name, tensor in dense.items():
        got = quant[name]
        want = got.dequantize() if isinstance(got, QuantizedWeight) else got
        # kept as stored (q/k rows un-permuted as bytes): exact
        torch.testing.assert_close(want, tensor, rtol=0, atol=0)
    assert arch.hidden_size == 256


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_are_held_as_the_files_bytes(tmp_path: Path, kind: str) -> None:
    """Every 2-D tensor of a K-quant file is held byte for byte as the file stores it (q/k
    rows un-permuted as whole rows), at the file's bits per weight."""
    path = make_tiny_gguf(tmp_path, "qwen2", tensor_type=kind, **MIXED)
    _, quant = load_gguf(path, torch.float32, "auto")
    gguf = read_gguf(path)
    for name, info in gguf.tensors.items():
        if len(info.shape) != 2:
            continue
        got = quant[hf_name(name, "qwen2")]
        assert isinstance(got, QuantizedWeight) and got.qtype == kind.lower()
        assert got.nbytes == info.data.nbytes
        assert got.nbytes * 8 / (got.shape[0] * got.shape[1]) == bits_per_weight(got.qtype)
        np.testing.assert_array_equal(got.data.numpy().reshape(-1), info.data.reshape(-1))


def test_k_quant_of_a_bad_size_names_the_tensor() -> None:
    raw = np.zeros(100, dtype=np.uint8)
    with pytest.raises(ModelLoadError, match=r"'w'.*Q4_K.*\[4, 512\].*1152 bytes.*holds 100"):
        from_gguf(raw, Q.Q4_K, (4, 512), name="w", path="f.gguf")
    with pytest.raises(ModelLoadError, match=r"'v'.*Q6_K.*\[2, 96\].*blocks of 256"):
        from_gguf(np.zeros(210, dtype=np.uint8), Q.Q6_K, (2, 96), name="v", path="f.gguf")


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
        "Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K",
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
