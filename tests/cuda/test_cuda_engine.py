"""The engine on a CUDA device (skipped without one; CI has none, a lent GPU machine runs it).

Everything here exists on CPU too; what these tests add is the device: weights, the KV pool
and the sampler on the GPU, host <-> device copies for swap preemption and the host prefix
tier, CUDA's default dtype. The model is a tiny random-weight Llama written by transformers,
and transformers on the same GPU is the reference. Run on a GPU machine with:

    KVSERVE_TEST_TOKENIZER_DIR=DIR python -m pytest -q tests/cuda

(``DIR``: tokenizer files from ``tests.tiny_models.tiny_tokenizer_dir()``, only where the
embedded model is not installed.)
"""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

NEW = 24
TOP_K = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=TOP_K)
# NOTE: fp32 on both sides, TF32 off (torch's default for matmuls): the engine and
# transformers differ only in summation order, ~1e-5 on a logprob for this model.
ATOL_LOGPROB = 1e-3
# Prompt lengths: one block, a partial block, several blocks, longer than the 16-token budget.
LENGTHS = [16, 5, 37, 70, 23, 50]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # NOTE: a wide initializer gives peaked logits, so greedy picks are no near-ties.
    return make_tiny_model(
        tmp_path_factory.mktemp("cuda"),
        "llama",
        num_hidden_layers=3,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=8,
        head_dim=16,
        initializer_range=0.1,
    )


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    # Distinct prompts that share a 16-token (one block) system-like prefix.
    prefix = [200 + 3 * j for j in range(16)]
    return [prefix + [1000 + 97 * i + 13 * j for j in range(n - 16)] for i, n in enumerate(LENGTHS)]


def _llm(model_dir: str, **kwargs: object) -> LLM:
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("max_model_len", 256)
    kwargs.setdefault("num_kv_blocks", 128)
    return LLM(model_dir, device="cuda", **kwargs)  # type: ignore[arg-type]


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens with a roomy pool and the default budget, prefix cache on."""
    llm = _llm(model_dir)
    out = _tokens(llm, prompts)
    assert llm.stats()["preemptions"] == 0
    return out


def test_weights_cache_and_outputs_live_on_the_gpu(model_dir: str) -> None:
    llm = _llm(model_dir)
    runner = llm.engine.runner
    assert runner.device.type == "cuda"
    assert all(p.device.type == "cuda" for p in runner.model.parameters())
    assert runner.kv_cache.device_cache.device.type == "cuda"
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_greedy_matches_transformers_on_the_gpu(
    model_dir: str, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """One mixed batch against transformers, token for token and logprob by logprob."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()
    llm = _llm(model_dir)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    worst = 0.0
    for prompt, out, expected in zip(prompts, outs, reference, strict=True):
        got = out.outputs[0]
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([prompt], device="cuda"),
                max_new_tokens=NEW,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=hf.config.eos_token_id,
                eos_token_id=None,
            )
        ref_tokens = ref.sequences[0, len(prompt) :].tolist()
        assert list(got.token_ids) == ref_tokens == expected, len(prompt)
        assert got.logprobs is not None
        for pos, entry in enumerate(got.logprobs):
            ref_lp = torch.log_softmax(ref.logits[pos][0].float(), dim=-1)
            for token_id, lp in entry.items():
                diff = abs(lp.logprob - ref_lp[token_id].item())
                worst = max(worst, diff)
                assert diff < ATOL_LOGPROB, (len(prompt), pos, token_id, diff)
    print(f"max |logprob diff| vs transformers on {torch.cuda.get_device_name()}: {worst:.2e}")


@pytest.mark.parametrize(
    ("variant", "kwargs"),
    [
        ("prefix cache off", {"enable_prefix_caching": False}),
        ("16-token budget", {"max_num_batched_tokens": 16}),
        ("recompute", {"num_kv_blocks": 14, "preemption_mode": "recompute"}),
        ("swap", {"num_kv_blocks": 14, "preemption_mode": "swap"}),
    ],
)
def test_memory_management_changes_no_token(
    model_dir: str,
    prompts: list[list[int]],
    reference: list[list[int]],
    variant: str,
    kwargs: dict,
) -> None:
    """Where KV lives and when it is computed change no greedy token on the GPU either."""
    llm = _llm(model_dir, block_size=16, **kwargs)
    assert _tokens(llm, prompts) == reference, variant
    stats = llm.stats()
    if "preemption_mode" in kwargs:
        # 14 blocks of 16 hold about two of these requests at once: others must wait or go.
        assert stats["preemptions"] > 0, variant
    assert stats["kv_usage"] == 0
    llm.engine.kv_cache_manager.check_integrity()


def test_prefix_cache_hits_on_the_second_pass(
    model_dir: str, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    llm = _llm(model_dir)
    assert _tokens(llm, prompts) == reference
    assert _tokens(llm, prompts) == reference
    assert llm.stats()["prefix_hit_rate"] > 0.4


def test_host_prefix_tier_round_trips_through_pinned_memory(
    model_dir: str, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """A device pool too small to keep every prefix: later hits load from the host tier."""
    llm = _llm(model_dir, num_kv_blocks=14, enable_host_prefix_cache=True, swap_space=1 << 22)
    assert llm.engine.runner.kv_cache.host_cache.is_pinned()
    for _ in range(2):
        assert _tokens(llm, prompts) == reference
    stats = llm.stats()
    assert stats["host_hit_tokens"] > 0
    llm.engine.kv_cache_manager.check_integrity()


def test_parallel_sampling_forks_share_blocks(
    model_dir: str, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    llm = _llm(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, n=4)
    outs = llm.generate(prompts[:2], params, use_tqdm=False)
    for out, expected in zip(outs, reference[:2], strict=True):
        assert [list(c.token_ids) for c in out.outputs] == [expected] * 4
    assert llm.stats()["fork_shared_blocks"] > 0


def test_seeded_sampling_repeats_on_the_gpu(model_dir: str, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=NEW, seed=7)
    first = _tokens(_llm(model_dir), prompts[:3], params)
    again = _tokens(_llm(model_dir), prompts[:3], params)
    assert first == again
    assert all(len(t) >= 1 for t in first)


def test_auto_dtype_is_half_precision_and_close_to_fp32(
    model_dir: str, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """CUDA's default dtype is bf16 (fp16 without bf16); its first tokens follow fp32's."""
    llm = _llm(model_dir, dtype="auto")
    want = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert llm.engine.runner.dtype == want
    assert llm.engine.runner.kv_cache.device_cache.dtype == want
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for out, expected in zip(outs, reference, strict=True):
        got = out.outputs[0]
        assert len(got.token_ids) == NEW
        # 8-bit mantissas may part from fp32 at a near-tie; up to it the tokens agree, and at
        # it fp32's token is among the half-precision run's top-k.
        for pos, (a, b) in enumerate(zip(got.token_ids, expected, strict=True)):
            if a != b:
                assert got.logprobs is not None and b in got.logprobs[pos], (pos, a, b)
                break


def test_abort_frees_the_gpu_blocks(model_dir: str, prompts: list[list[int]]) -> None:
    llm = _llm(model_dir)
    engine = llm.engine
    params = SamplingParams(max_tokens=150, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"r{i}")
    for _ in range(3):
        engine.step()
    for i in range(len(prompts)):
        engine.abort_request(f"r{i}")
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.stats()["kv_usage"] == 0
    engine.kv_cache_manager.check_integrity()


def test_never_fit_request_is_rejected(model_dir: str) -> None:
    llm = _llm(model_dir, num_kv_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="block"):
        llm.generate([[1] * 100], SamplingParams(max_tokens=100), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
