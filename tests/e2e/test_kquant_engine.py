"""A tiny Q4_K_M-style GGUF (Q4_K layers, some Q6_K and Q5_K tensors, a Q6_K tied embedding)
served as stored: the engine's greedy tokens and log-probabilities against the dequantized
twin (the same weights' exact values in fp32), the bytes held, and the kernel selection.

Bound: the kernels round each activation to int8 per block of 32, so every projection is off
by about 1/254 of its inputs' block maxima (tests/runtime/test_quant_kernels.py); over two
layers and the lm_head that stays within 3 % of the logits' range (``assert_close_to_twin``),
and so a log-probability within twice that.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.engine.llm import LLM
from kvserve.models.gguf_reader import read_gguf
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.quant import QuantizedWeight, bits_per_weight
from kvserve.runtime.attention.metadata import SeqSpec, build_attention_metadata
from kvserve.runtime.native import quant_ops
from kvserve.sampling_params import SamplingParams
from tests.runtime.test_quant_model import build, build_twin
from tests.tiny_gguf import make_tiny_gguf

pytestmark = pytest.mark.skipif(not quant_ops.load(), reason="quantized kernels unavailable")

CPU = torch.device("cpu")
SIZES = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}  # rows of 256 values
# As llama.cpp's Q4_K_M: Q4_K, with Q6_K for the embedding / output and some v / down
# tensors; one Q5_K tensor besides (Q5_K_M's).
TYPES = {
    "token_embd.weight": "Q6_K",
    "blk.0.attn_v.weight": "Q6_K",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.ffn_up.weight": "Q5_K",
}
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [900, 12, 4000, 77], [31, 41, 59, 26, 53, 58, 97, 93, 23]]
NEW = 8


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("kquant")
    return make_tiny_gguf(
        tmp, "smollm", tensor_type="Q4_K", tensor_types=TYPES, tokenizer=True, **SIZES
    )


@torch.no_grad()
def twin_logprobs(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits after each prefix of ``ids`` (one chunk). [T, V]"""
    arch, n = model.arch, len(ids)
    caches = [
        torch.zeros(2, 2, 16, arch.num_key_value_heads, arch.head_dim)
        for _ in range(arch.num_hidden_layers)
    ]
    meta = build_attention_metadata(
        [SeqSpec(0, n, 0, [0, 1])], block_size=16, device=CPU, dtype=torch.float32
    )
    hidden = model(torch.tensor(ids), torch.arange(n), caches, meta)
    return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


def test_engine_serves_k_quants_as_stored_and_matches_the_dequantized_twin(
    gguf_path: str,
) -> None:
    llm = LLM(
        gguf_path,
        dtype="float32",
        quantization="auto",
        kernel_selection="off",
        num_kv_blocks=32,
        max_model_len=64,
    )
    held = llm.stats()["quantization"]["weight_bytes_by_format"]
    file_bytes: dict[str, int] = {}
    for info in read_gguf(gguf_path).tensors.values():
        if len(info.shape) == 2:
            kind = info.ggml_type.name.lower()
            file_bytes[kind] = file_bytes.get(kind, 0) + info.data.nbytes
    assert {k: held[k] for k in file_bytes} == file_bytes  # the file's bytes, nothing more
    assert file_bytes.keys() == {"q4_k", "q5_k", "q6_k"}
    params = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=5, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    twin = build_twin(gguf_path, "auto")
    agree = total = 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        got = out.outputs[0]
        ref = twin_logprobs(twin, prompt + list(got.token_ids))[len(prompt) - 1 : -1]  # [NEW, V]
        bound = 2 * 0.03 * (ref.max(dim=-1).values - ref.min(dim=-1).values)
        assert got.logprobs is not None
        for pos, (token, entry) in enumerate(zip(got.token_ids, got.logprobs, strict=True)):
            agree += int(ref[pos].argmax().item() == token)
            total += 1
            for token_id, lp in entry.items():
                diff = abs(lp.logprob - ref[pos, token_id].item())
                assert diff <= bound[pos], (pos, token_id, diff, float(bound[pos]))
    assert agree >= 0.8 * total, f"{agree} of {total} greedy tokens are the twin's argmax"


def test_model_runs_k_quant_kernels_and_their_selection(tmp_path: Path) -> None:
    from kvserve.models.quant_select import quantized_shapes, select_quantized_kernels
    from kvserve.runtime.autotune.candidates import m_buckets

    # NOTE: a small vocabulary: the selection times dense copies of every shape, the lm_head's
    # at 49152 rows took most of this test's time.
    path = make_tiny_gguf(
        tmp_path, "smollm", tensor_type="Q4_K", tensor_types=TYPES, vocab_size=512, **SIZES
    )
    model = build(path, "auto")
    isa = quant_ops.best_isa()
    model.ensure_linears()
    layer0, layer1 = model.layers[0], model.layers[1]
    assert layer0.qkv_proj.method_for(1).name == f"split_{isa}"  # q/k in Q4_K, v in Q6_K
    assert layer0.down_proj.method_for(1).name == f"q6_k_{isa}"
    assert layer1.gate_up_proj.method_for(1).name == f"split_{isa}"  # Q4_K + Q5_K
    assert layer1.down_proj.method_for(1).name == f"q4_k_{isa}"
    head = model.quantized["lm_head"]
    assert isinstance(head, QuantizedWeight) and head is model.quantized["embed_tokens"]
    assert head.qtype == "q6_k" and head.layout == "plain"
    assert head.nbytes * 8 == bits_per_weight("q6_k") * head.shape[0] * head.shape[1]
    shapes = quantized_shapes(model)
    assert set(shapes.values()) == {"q4_k", "q6_k"}
    plan = select_quantized_kernels(
        model, act_dtype=torch.float32, budget_s=0.001, directory=tmp_path / "cache"
    )
    assert plan.keys() == shapes.keys()
    for shape, choice in plan.items():
        assert [b for b, _ in choice] == [b for b, _ in m_buckets()]
        assert {name for _, name in choice} <= {
            f"{shapes[shape]}_{isa}",
            "dequant_tile_fp32",
            "dequant_fp32",
            "dequant_onednn_fp32",
        }
