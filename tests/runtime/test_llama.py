"""Our Llama-family forward over the paged cache vs HuggingFace transformers.

Tolerance: atol 1e-4 on logits of magnitude ~5 (fp32). Our forward fuses q/k/v and gate/up
matmuls, uses fused rms_norm/addcmul and SDPA, so float sums run in a different order than
HF's; the observed max difference is ~5e-6.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.models.decoder_layer import PROJECTIONS
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.rope import compute_inv_freq, rope_cos_sin
from kvserve.runtime import native
from kvserve.runtime.attention.metadata import SeqSpec, build_attention_metadata
from kvserve.runtime.autotune.candidates import (
    candidate_methods,
    onednn_available,
    onednn_supports,
)
from kvserve.runtime.kv_cache import KVCache
from kvserve.runtime.linear import M_MAX, dtype_tag
from kvserve.runtime.workspace import Workspace
from tests.runtime.runtime_testutil import ToyAllocator, hf_logits, ours_from_hf, tiny_hf_model

ATOL = 1e-4
CPU = torch.device("cpu")


def _run_schedule(
    model: LlamaForCausalLM,
    seqs: dict[str, list[int]],
    chunk_sizes: dict[str, list[int]],
    block_size: int = 4,
) -> dict[str, torch.Tensor]:
    """Compute every position's logits of each sequence, as a ragged batch of steps.

    Step j computes the next ``chunk_sizes[rid][j]`` tokens of every sequence that has any
    left, all in one flat batch; returns [len, vocab] logits per sequence.
    """
    arch = model.arch
    alloc = ToyAllocator(num_blocks=128, block_size=block_size, seed=3)
    cache = KVCache(
        num_layers=arch.num_hidden_layers,
        num_blocks=128,
        block_size=block_size,
        num_kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        dtype=model.norm.dtype,
    )
    done = dict.fromkeys(seqs, 0)
    logits: dict[str, list[torch.Tensor]] = {rid: [] for rid in seqs}
    step = 0
    while any(done[r] < len(t) for r, t in seqs.items()):
        specs, ids, positions, order = [], [], [], []
        for rid, tokens in seqs.items():
            if done[rid] == len(tokens):
                continue
            sizes = chunk_sizes[rid]
            n = min(sizes[min(step, len(sizes) - 1)], len(tokens) - done[rid])
            table = alloc.ensure(rid, done[rid] + n)
            specs.append(SeqSpec(len(ids), n, done[rid], list(table)))
            ids.extend(tokens[done[rid] : done[rid] + n])
            positions.extend(range(done[rid], done[rid] + n))
            order.append((rid, n))
            done[rid] += n
        meta = build_attention_metadata(
            specs,
            block_size=block_size,
            device=CPU,
            dtype=model.norm.dtype,
            sliding_window=arch.shared_window,  # a layer's own: the model applies it
        )
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.tensor(positions), cache.layer_caches, meta)
            out = model.compute_logits(hidden)
        row = 0
        for rid, n in order:
            logits[rid].append(out[row : row + n])
            row += n
        step += 1
    return {rid: torch.cat(parts) for rid, parts in logits.items()}


def _prompts(lengths: list[int], vocab: int, seed: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"s{i}": torch.randint(0, vocab, (n,), generator=gen).tolist()
        for i, n in enumerate(lengths)
    }


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "gemma3"])
@pytest.mark.parametrize(
    ("backend", "native_ops"),
    [("torch_sdpa", False), ("torch_ref", False), ("native", True)],
    ids=["torch_sdpa", "torch_ref", "native"],
)
def test_ragged_chunked_prefill_then_decode_matches_hf(
    kind: str, backend: str, native_ops: bool
) -> None:
    if native_ops and not native.available():
        pytest.skip(f"native kernels unavailable: {native.reason()}")
    hf = tiny_hf_model(kind)
    model, _ = ours_from_hf(hf, attn_backend=backend, native_ops=native_ops)
    seqs = _prompts([1, 7, 23, 40], hf.config.vocab_size, seed=11)
    # Chunked prefill (several chunk sizes, some mid-block), then one token per step (decode).
    chunks = {
        "s0": [1],
        "s1": [3, 2, 1],
        "s2": [5, 9, 4, 1],
        "s3": [16, 6, 10, 1],
    }
    ours = _run_schedule(model, seqs, chunks)
    for rid, tokens in seqs.items():
        ref = hf_logits(hf, tokens)
        torch.testing.assert_close(ours[rid], ref, atol=ATOL, rtol=0, msg=f"{kind} {rid}")


@pytest.mark.parametrize("backend", ["torch_sdpa", "auto"])
def test_sliding_window_matches_hf(backend: str) -> None:
    hf = tiny_hf_model("mistral", sliding_window=6)
    hf.config._attn_implementation = "eager"
    model, arch = ours_from_hf(hf, attn_backend=backend)
    assert arch.sliding_window == 6
    seqs = _prompts([30, 11], hf.config.vocab_size, seed=5)
    ours = _run_schedule(model, seqs, {"s0": [9, 8, 1], "s1": [11, 1]})
    for rid, tokens in seqs.items():
        torch.testing.assert_close(ours[rid], hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_whole_prompt_in_one_step_matches_chunked() -> None:
    hf = tiny_hf_model("llama")
    model, _ = ours_from_hf(hf)
    seqs = _prompts([37], hf.config.vocab_size, seed=2)
    whole = _run_schedule(model, seqs, {"s0": [37]})["s0"]
    chunked = _run_schedule(model, seqs, {"s0": [4, 13, 1]})["s0"]
    torch.testing.assert_close(whole, chunked, atol=ATOL, rtol=0)


def test_llama3_rope_scaling_changes_frequencies() -> None:
    base = compute_inv_freq(64, 500000.0, None)
    scaled = compute_inv_freq(
        64,
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    assert torch.equal(scaled[:4], base[:4])  # high frequencies untouched
    torch.testing.assert_close(scaled[-1], base[-1] / 8)  # lowest frequency divided by factor
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'mrope'"):
        compute_inv_freq(64, 1e4, {"rope_type": "mrope", "factor": 2.0})


def test_load_weights_rejects_bad_state_dicts() -> None:
    hf = tiny_hf_model("llama")
    model, arch = ours_from_hf(hf)
    sd = dict(hf.state_dict())
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="missing weight 'model.layers.1.mlp.up_proj.weight'"):
        LlamaForCausalLM(arch).load_weights(missing)
    bad_shape = dict(sd)
    bad_shape["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
        LlamaForCausalLM(arch).load_weights(bad_shape)
    extra = dict(sd)
    extra["model.layers.9.foo"] = torch.ones(1)
    with pytest.raises(ValueError, match="unexpected weights"):
        LlamaForCausalLM(arch).load_weights(extra)


def test_fused_weights_hold_hf_tensors() -> None:
    hf = tiny_hf_model("qwen2")
    model, _ = ours_from_hf(hf)
    layer, sd = model.layers[1], hf.state_dict()
    qs, kvs = layer.q_size, layer.kv_size
    assert torch.equal(
        layer.qkv_weight[qs : qs + kvs], sd["model.layers.1.self_attn.k_proj.weight"]
    )
    assert torch.equal(layer.qkv_bias[qs + kvs :], sd["model.layers.1.self_attn.v_proj.bias"])
    inter = layer.intermediate_size
    assert torch.equal(layer.gate_up_weight[inter:], sd["model.layers.1.mlp.up_proj.weight"])
    assert model.lm_head is model.embed_tokens  # tied


def test_gqa_heads_must_divide() -> None:
    arch = ours_from_hf(tiny_hf_model("llama"))[1]
    from dataclasses import replace

    with pytest.raises(ValueError, match="must be a multiple of num_key_value_heads"):
        LlamaForCausalLM(replace(arch, num_key_value_heads=3))


def test_linear_weights_are_stored_transposed_through_dtype_moves() -> None:
    """Linear weights keep the HF [out, in] shape but [in, out] contiguous storage (the fast
    right operand of x @ w.t()), also after Module.to; the embedding table stays row-major."""
    model, _ = ours_from_hf(tiny_hf_model("llama"))
    for m in (model, model.to(torch.float64)):
        layer = m.layers[0]
        for w in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight):
            assert w.t().is_contiguous() and not w.is_contiguous(), w.shape
        assert m.embed_tokens.is_contiguous()


def test_layer_with_shared_step_views_equals_fresh_buffers() -> None:
    """Layers that share one step's workspace views give bitwise the same output as a layer
    run with its own fresh buffers."""
    model, arch = ours_from_hf(tiny_hf_model("qwen2"))
    gen = torch.Generator().manual_seed(4)
    n = 7
    seqs = [SeqSpec(0, n, 0, [0, 1])]
    meta = build_attention_metadata(
        seqs, block_size=4, device=torch.device("cpu"), dtype=torch.float32
    )
    hidden = torch.randn(n, arch.hidden_size, generator=gen)
    cos, sin = rope_cos_sin(model._inv_freq, torch.arange(n), torch.float32)
    results = []
    for shared in (True, False):
        caches = KVCache(
            num_layers=len(model.layers),
            num_blocks=4,
            block_size=4,
            num_kv_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
        ).layer_caches
        h = hidden.clone()
        ws = Workspace()
        views = model.layers[0].step_views(ws, h) if shared else None
        with torch.inference_mode():
            residual = None
            for layer, cache in zip(model.layers, caches, strict=True):
                residual = layer(h, cos, sin, cache, meta, ws if shared else None, views, residual)
            h.add_(residual)
        results.append(h)
    assert torch.equal(results[0], results[1])


class _EveryShape(dict):
    """A linear plan that names one method for every weight shape and every M."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def get(self, key, default=None):  # type: ignore[no-untyped-def]
        return [(M_MAX, self.name)]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("native_ops", [False, True])
@pytest.mark.parametrize(
    ("dtype", "atol"),
    # NOTE: bf16 rounds weights and every activation to 8 significant bits: on the tiny
    # random models the logits (magnitude ~5) move by up to ~0.1 from the fp32 reference.
    [(torch.float32, ATOL), (torch.bfloat16, 0.25)],
)
def test_every_linear_method_as_the_models_kernel_matches_hf(
    kind: str, native_ops: bool, dtype: torch.dtype, atol: float
) -> None:
    if native_ops and not native.available():
        pytest.skip(f"native kernels unavailable: {native.reason()}")
    hf = tiny_hf_model(kind)
    model, _ = ours_from_hf(hf, attn_backend="auto" if native_ops else "torch_sdpa")
    model.set_native_ops(native_ops)
    model = model.to(dtype)
    seqs = _prompts([9, 23], hf.config.vocab_size, seed=7)
    chunks = {"s0": [4, 1], "s1": [16, 1]}
    names = [
        m.name for m in candidate_methods(model.layers[0].qkv_weight, act_dtype=dtype, device=CPU)
    ]
    assert names, "no candidate"
    for name in names:
        model.set_linear_plan(_EveryShape(name))
        assert {m.name for lin in model.linears() for m in lin.methods()} == {name}
        ours = _run_schedule(model, seqs, chunks)
        for rid, tokens in seqs.items():
            torch.testing.assert_close(
                ours[rid].float(), hf_logits(hf, tokens), atol=atol, rtol=0, msg=f"{name} {rid}"
            )


@pytest.mark.skipif(not onednn_available(), reason="oneDNN unavailable in torch")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_releasing_prepacked_weights_frees_them_and_keeps_outputs(dtype: torch.dtype) -> None:
    """A parameter that only a prepacked copy reads is freed (its bytes leave the
    parameters, the copy still counts), the outputs stay bit for bit, and the weights come
    back exactly when the projections are rebuilt."""
    if not onednn_supports(dtype):
        pytest.skip(f"oneDNN has no {dtype} linear on this CPU")
    hf = tiny_hf_model("qwen2")  # with q/k/v biases
    model, _ = ours_from_hf(hf, attn_backend="torch_sdpa")
    model = model.to(dtype)
    seqs = _prompts([9, 23], hf.config.vocab_size, seed=5)
    chunks = {"s0": [4, 1], "s1": [16, 1]}
    model.set_linear_plan(_EveryShape(f"onednn_prepacked_{dtype_tag(dtype)}"))
    before = _run_schedule(model, seqs, chunks)
    weights = {
        (i, p): getattr(lay, f"{p}_weight").clone()
        for i, lay in enumerate(model.layers)
        for p in PROJECTIONS
    }
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = sum(lin.extra_nbytes for lin in model.linears())

    freed = model.release_packed_weights()

    expected = sum(w.numel() * w.element_size() for w in weights.values())
    assert freed == expected == model.released_weight_bytes() > 0
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == params - freed
    assert sum(lin.extra_nbytes for lin in model.linears()) == packed  # still held, counted
    assert all(
        lin.source.numel() == 0
        for lay in model.layers
        for lin in (lay.qkv_proj, lay.o_proj, lay.gate_up_proj, lay.down_proj)
    )
    after = _run_schedule(model, seqs, chunks)
    for rid in seqs:
        assert torch.equal(before[rid], after[rid])
    assert model.release_packed_weights() == 0  # nothing left to free

    model.set_linear_plan(None)  # torch.mm reads the parameters: they come back first
    model.ensure_linears()
    assert model.released_weight_bytes() == 0
    for (i, p), w in weights.items():
        got = getattr(model.layers[i], f"{p}_weight")
        assert torch.equal(got, w) and got.stride() == w.stride()
    assert model.release_packed_weights() == 0  # torch.mm shares the source: kept
    mm = _run_schedule(model, seqs, chunks)
    for rid in seqs:
        torch.testing.assert_close(
            mm[rid], before[rid], atol=0.25 if dtype != torch.float32 else 1e-4, rtol=0
        )


@pytest.mark.skipif(not onednn_available(), reason="oneDNN unavailable in torch")
def test_load_weights_after_release_restores_full_parameters() -> None:
    hf = tiny_hf_model("llama")
    model, _ = ours_from_hf(hf, attn_backend="torch_sdpa")
    sd = hf.state_dict()
    model.set_linear_plan(_EveryShape("onednn_prepacked_fp32"))
    assert model.release_packed_weights() > 0
    model.load_weights(sd)
    assert model.released_weight_bytes() == 0
    layer = model.layers[1]
    assert torch.equal(layer.down_weight, sd["model.layers.1.mlp.down_proj.weight"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tables_are_rope_cos_sin_bit_for_bit(dtype: torch.dtype) -> None:
    """The forward gathers cos / sin rows from per-model tables: the same values as
    computing them for the step's positions, and a table grows to cover longer contexts."""
    hf = tiny_hf_model("llama")
    model, _ = ours_from_hf(hf)
    positions = torch.tensor([0, 5, 63, 64, 300, 1023, 17])
    cos_t, sin_t = model.rope_tables(1024, CPU, dtype)
    assert cos_t.shape[0] >= 1024 and sin_t.shape == cos_t.shape
    inv = compute_inv_freq(model.arch.head_dim, model.arch.rope_theta, model.arch.rope_scaling)
    cos, sin = rope_cos_sin(inv, positions, dtype)
    assert torch.equal(cos_t[positions], cos) and torch.equal(sin_t[positions], sin)
    small = model.rope_tables(10, CPU, dtype)[0]
    assert small is cos_t  # covered already: no new table
    assert model.rope_tables(5000, CPU, dtype)[0].shape[0] >= 5000
