"""Mixture of experts (``kvserve/models/moe.py``, ``moe_weights.py``): the grouped MoE
against a per-token loop, GGUF twins of Mixtral / Qwen2-MoE / Qwen3-MoE (F32 bit for bit,
quantized experts run as stored), the checkpoint layouts, tensor-parallel slices of the
experts, and the bad-input errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvserve.config import ModelArchConfig
from kvserve.distributed.sharding import OVERSUBSCRIBE_ENV, ShardSpec, validate_tp
from kvserve.models import ModelLoadError, load_model
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.moe import SparseMoeBlock
from kvserve.models.quant import QuantizedWeight, quantize_dense
from kvserve.models.quant_model import quantized_nbytes
from kvserve.runtime.autotune.candidates import build_linear
from kvserve.runtime.layer_ops import TORCH_OPS
from kvserve.runtime.native import quant_ops
from tests.runtime.test_quant_model import assert_close_to_twin, build, build_twin, logits
from tests.tiny_gguf import make_tiny_gguf
from tests.tiny_models import edit_config, make_tiny_model

SMALL = {"vocab_size": 256}
FAMILIES = ("mixtral", "qwen2moe", "qwen3moe")


def _arch(**moe: object) -> ModelArchConfig:
    fields = {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    return ModelArchConfig("qwen2moe", 64, 64, 64, 1, 4, 2, 16, 128, **{**fields, **moe})


def _random_block(arch: ModelArchConfig, seed: int = 0) -> SparseMoeBlock:
    gen = torch.Generator().manual_seed(seed)
    block = SparseMoeBlock(arch, dtype=torch.float32, device=torch.device("cpu"))
    for p in block.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return block


def _make(weight: object, bias: torch.Tensor | None) -> object:
    return build_linear(weight, bias, act_dtype=torch.float32, device=torch.device("cpu"))


def _per_token(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The reference: each token alone, each of its experts alone, weights summed in
    expert order (transformers' order), the shared expert added last."""
    weights, experts, logits = block.route(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in torch.argsort(experts[t]).tolist():
            e = int(experts[t, j])
            gate_up = block.gate_up_projs[e](x[t : t + 1])
            gate, up = gate_up.chunk(2, dim=-1)
            y = block.down_projs[e](F.silu(gate) * up)[0]
            out[t] += y * weights[t, j]
    if block.shared_projs is not None:
        gate, up = block.shared_projs[0](x).chunk(2, dim=-1)
        shared = block.shared_projs[1](F.silu(gate) * up)
        out += torch.sigmoid(logits[:, block.num_experts :]) * shared
    return out


@pytest.mark.parametrize(
    "moe",
    [
        {"norm_topk_prob": True},
        {"norm_topk_prob": False, "shared_expert_intermediate_size": 64},
        {"num_experts_per_tok": 6},  # every expert for every token
    ],
)
@torch.no_grad()
def test_grouped_moe_equals_per_token_loop(moe: dict[str, object]) -> None:
    arch = _arch(**moe)
    block = _random_block(arch)
    block.build_linears(_make, {})
    x = torch.randn(13, arch.hidden_size, generator=torch.Generator().manual_seed(1))
    weights, experts, _ = block.route(x)
    assert len(set(experts.flatten().tolist())) > 2  # several experts run
    if arch.norm_topk_prob:
        torch.testing.assert_close(weights.sum(-1), torch.ones(13))
    got = block.forward(x, TORCH_OPS)
    torch.testing.assert_close(got, _per_token(block, x), rtol=1e-5, atol=1e-5)
    # one token: a decode step
    torch.testing.assert_close(block.forward(x[:1], TORCH_OPS), _per_token(block, x[:1]))


@pytest.mark.skipif(not quant_ops.load(), reason="quantized kernels unavailable")
@torch.no_grad()
def test_grouped_moe_with_quantized_experts_equals_per_token_loop() -> None:
    arch = _arch(shared_expert_intermediate_size=64)
    block = _random_block(arch)
    sources = {
        f"experts.{kind}.{e}": quantize_dense(stack[e], "q8_0")
        for kind, stack in (("gate_up", block.experts_gate_up), ("down", block.experts_down))
        for e in range(arch.num_experts)
    }
    block.build_linears(_make, sources)
    assert block.gate_up_projs[0].method_for(1).name.startswith("q8_0")
    x = torch.randn(9, arch.hidden_size, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(block.forward(x, TORCH_OPS), _per_token(block, x))


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_and_stacked_hf_equal_the_hf_twin(tmp_path: Path, family: str) -> None:
    """The same weights, bit for bit, from per-expert safetensors (as the Hub holds them),
    transformers 5's stacked ones and llama.cpp's stacked F32 GGUF tensors."""
    twin = load_model(make_tiny_model(tmp_path, family, tokenizer=False, **SMALL))
    stacked = load_model(
        make_tiny_model(tmp_path, family, tokenizer=False, fused_experts=True, **SMALL)
    )
    gguf = load_model(make_tiny_gguf(tmp_path, family, tensor_type="F32", **SMALL))
    assert twin.arch.architecture == family and twin.arch.num_experts == 4
    assert stacked.arch == twin.arch
    # NOTE: GGUF stores the norm epsilon as float32.
    assert dataclasses.replace(gguf.arch, rms_norm_eps=twin.arch.rms_norm_eps) == twin.arch
    for loaded in (stacked, gguf):
        assert sorted(loaded.state_dict) == sorted(twin.state_dict)
        for name, tensor in loaded.state_dict.items():
            assert torch.equal(tensor, twin.state_dict[name]), name


@pytest.mark.skipif(not quant_ops.load(), reason="quantized kernels unavailable")
@pytest.mark.parametrize("family", ["mixtral", "qwen2moe"])
def test_quantized_gguf_experts_run_as_stored(tmp_path: Path, family: str) -> None:
    path = make_tiny_gguf(tmp_path, family, tensor_type="Q8_0", **SMALL)
    quant, dense = build(path, "auto"), build_twin(path, "auto")
    moe = quant.layers[1].moe
    assert moe is not None and moe.experts_gate_up.numel() == moe.experts_down.numel() == 0
    assert moe.router.dtype == torch.float32 and moe.router.numel() > 0  # routers stay dense
    names = {lin.method_for(1).name for lin in quant.linears()}
    assert all(name.startswith("q8_0") for name in names), names
    blocks = sum(
        v.nbytes
        for v in load_model(path, "float32", "auto").state_dict.values()
        if isinstance(v, QuantizedWeight)
    )
    assert quantized_nbytes(quant) == blocks
    assert_close_to_twin(logits(quant), logits(dense))


def test_hf_more_experts_per_token_than_experts_is_named(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "mixtral", tokenizer=False, **SMALL)
    edit_config(model_dir, num_experts_per_tok=5)
    with pytest.raises(ModelLoadError, match=r"config\.json: 'num_experts_per_tok' \(5\) exceeds"):
        load_model(model_dir)
    edit_config(model_dir, num_experts_per_tok=2, num_local_experts=None)
    with pytest.raises(ValueError, match=r"config\.json: required key 'num_local_experts'"):
        load_model(model_dir)


def test_hf_bad_mlp_only_layers_is_named(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "qwen3moe", tokenizer=False, **SMALL)
    edit_config(model_dir, mlp_only_layers=[7])
    with pytest.raises(ValueError, match=r"config\.json: 'mlp_only_layers' must list"):
        load_model(model_dir)


def test_hf_stacked_experts_of_the_wrong_count_are_named(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "mixtral", tokenizer=False, fused_experts=True, **SMALL)
    edit_config(model_dir, num_local_experts=8)
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.experts\.(gate_up|down)_proj' "
        r"has shape \[4, .*the config implies \[8, ",
    ):
        load_model(model_dir)


def test_hf_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_model(tmp_path, "qwen3moe", tokenizer=False, **SMALL)
    path = f"{model_dir}/model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.experts.3.down_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError, match=r"1 tensor\(s\) missing: model\.layers\.1\.mlp\.experts\.3\.down"
    ):
        load_model(model_dir)


def test_gguf_missing_expert_tensor_and_bad_counts_are_named(tmp_path: Path) -> None:
    path = make_tiny_gguf(tmp_path, "qwen3moe", drop_tensors=("blk.1.ffn_up_exps.weight",), **SMALL)
    with pytest.raises(ValueError, match=r"\.gguf: 4 tensor\(s\) missing: model\.layers\.1\."):
        load_model(path)
    path = make_tiny_gguf(tmp_path, "mixtral", metadata={"llama.expert_used_count": 9}, **SMALL)
    with pytest.raises(ValueError, match=r"\.gguf: 'llama\.expert_used_count' \(9\) exceeds"):
        load_model(path)


@pytest.mark.parametrize("family", ["qwen2moe", "mixtral"])
@torch.no_grad()
def test_tensor_parallel_shards_sum_to_the_full_experts(
    tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks' slices of every expert (and the shared one), run on the same input and
    summed (what the all-reduce does), give the whole MoE block's output."""
    monkeypatch.setenv(OVERSUBSCRIBE_ENV, "1")  # a 1-core runner may check 2 ranks too
    loaded = load_model(make_tiny_model(tmp_path, family, tokenizer=False, **SMALL))
    validate_tp(loaded.arch, 2)

    def model(arch: ModelArchConfig, state_dict: dict) -> LlamaForCausalLM:
        m = LlamaForCausalLM(arch)
        m.load_weights(state_dict)
        m.ensure_linears()
        return m

    full = model(loaded.arch, loaded.state_dict)
    specs = [ShardSpec(loaded.arch, 2, rank) for rank in range(2)]
    ranks = [model(s.local_arch(), s.shard_state_dict(loaded.state_dict)) for s in specs]
    assert ranks[1].layers[1].moe.inter == loaded.arch.moe_intermediate_size // 2
    x = torch.randn(11, loaded.arch.hidden_size, generator=torch.Generator().manual_seed(3))
    want = full.layers[1].moe.forward(x, TORCH_OPS)
    got = sum(r.layers[1].moe.forward(x, TORCH_OPS) for r in ranks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    bad = dataclasses.replace(loaded.arch, moe_intermediate_size=33)
    with pytest.raises(ValueError, match="does not divide the expert MLP width 33"):
        validate_tp(bad, 2)


@pytest.mark.parametrize("family", ["mixtral", "qwen2moe"])
def test_written_hf_dir_loads_in_transformers(tmp_path: Path, family: str) -> None:
    """``write_hf_dir`` of a MoE GGUF (the export the peers read): transformers loads the
    weights of the HF twin, and our loader reads back the same architecture and weights."""
    from transformers import AutoModelForCausalLM

    from kvserve.models.export import write_hf_dir

    loaded = load_model(make_tiny_gguf(tmp_path, family, tensor_type="F32", **SMALL))
    out = str(tmp_path / "exported")
    write_hf_dir(loaded.arch, loaded.state_dict, out, pad_token_id=2)
    twin = make_tiny_model(tmp_path, family, tokenizer=False, **SMALL)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    want = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).state_dict()
    assert sorted(theirs) == sorted(want)
    assert all(torch.equal(t, want[n]) for n, t in theirs.items())
    again = load_model(out)
    assert dataclasses.replace(again.arch, rms_norm_eps=loaded.arch.rms_norm_eps) == loaded.arch
    assert all(torch.equal(t, loaded.state_dict[n]) for n, t in again.state_dict.items())


@pytest.mark.parametrize("family", ["qwen2moe", "qwen3moe"])
def test_transformers_reads_the_same_gguf_experts(tmp_path: Path, family: str) -> None:
    """transformers' own GGUF reader on our test files: the experts stacked, routers and the
    shared-expert gate as llama.cpp writes them (the twin's weights, F16-rounded where the
    file holds F16). NOTE: transformers does not read the experts' widths from GGUF
    metadata (``expert_feed_forward_length``); they are passed in."""
    import os

    from transformers import AutoModelForCausalLM

    pad = {"tokenizer.ggml.padding_token_id": 2}
    path = make_tiny_gguf(tmp_path, family, tensor_type="F16", metadata=pad, **SMALL)
    widths = {"moe_intermediate_size": 32, "norm_topk_prob": family == "qwen3moe"}
    if family == "qwen2moe":
        widths["shared_expert_intermediate_size"] = 64
    theirs = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32, **widths
    ).state_dict()
    twin = make_tiny_model(tmp_path, family, tokenizer=False, **SMALL)
    want = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).state_dict()
    assert sorted(theirs) == sorted(want)
    for name, tensor in theirs.items():
        exact = want[name]
        assert torch.equal(tensor, exact) or torch.equal(tensor, exact.half().float()), name
