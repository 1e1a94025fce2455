"""Each model family the HF loader takes, served by the engine, against transformers.

For every family a tiny random checkpoint (2 layers, hidden 64, vocabulary 512) is built
with transformers from the family's config class and saved with ``save_pretrained`` (some
sharded with an index, some stored in bf16). kvserve serves one mixed batch of prompts that
share a prefix, through chunked prefill (16-token steps, 4-token blocks) and, run again,
through prefix-cache hits; transformers (fp32, the same weights) is the reference, checked
by teacher forcing as in ``test_hf_reference.py``: the greedy tokens must be its argmax at
every position and each returned top-5 log-probability within 1e-4 of its own.

The Gemma cases run three layers (sliding, full, sliding) with a window of 8 tokens under
prompts of 15 to 43, so every sliding layer's window cuts; their KV pool is small enough
that a request is preempted (and recomputed) on the way.

NOTE: 1e-4: both sides compute in fp32 from identical weights, differing in summation order
only (fused projections, paged attention); the observed worst is printed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model

ATOL_LOGPROB = 1e-4
NUM_NEW = 6
PREFIX = [300 + 7 * j for j in range(12)]
# NOTE: a wide initializer gives peaked logits, so greedy picks are no near-ties.
TINY = {"vocab_size": 512, "initializer_range": 0.1}

# name -> (family, config overrides, save options, engine max_model_len, prompt lengths)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any], int, tuple[int, ...]]] = {
    "llama3-rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        },
        {},
        128,
        (3, 9, 20, 31),
    ),
    "mistral-window-linear": (
        "mistral",
        {"sliding_window": 8, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {},
        128,
        (3, 9, 20, 31),
    ),
    "qwen2-yarn": (
        "qwen2",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        },
        {"max_shard_size": "200KB"},
        128,
        (3, 9, 20, 31),
    ),
    "qwen3": (
        "qwen3",
        {"tie_word_embeddings": True},
        {"max_shard_size": "200KB", "dtype": "bfloat16"},
        128,
        (3, 9, 20, 31),
    ),
    # LongRoPE, served within the pretraining context: the short factors.
    "phi3-short": (
        "phi3",
        {"original_max_position_embeddings": 256, "rope_scaling": "longrope"},
        {"dtype": "bfloat16"},
        256,
        (3, 9, 20, 31),
    ),
    # Served past it (max_model_len 128 > 32): the long factors, every prompt past 32 tokens.
    "phi3-long": (
        "phi3",
        {
            "max_position_embeddings": 128,
            "original_max_position_embeddings": 32,
            "rope_scaling": "longrope",
        },
        {"max_shard_size": "200KB"},
        128,
        (22, 25, 30, 41),
    ),
    # Mixture of experts (4 experts, top 2), in a KV pool small enough to preempt.
    # Mixtral's experts stacked as transformers 5 holds them (experts.gate_up_proj).
    "mixtral": ("mixtral", {}, {"fused_experts": True}, 128, (3, 9, 20, 31)),
    # Qwen2-MoE: q/k/v biases, a sigmoid-gated shared expert, top-k weights not renormalized.
    "qwen2moe": (
        "qwen2moe",
        {},
        {"max_shard_size": "200KB", "dtype": "bfloat16"},
        128,
        (3, 9, 20, 31),
    ),
    # Soft caps tight enough to bite (scores and logits of a few units), scale 24 ** -0.5.
    "gemma2": (
        "gemma2",
        {
            "num_hidden_layers": 3,
            "sliding_window": 8,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0,
        },
        {},
        128,
        (3, 9, 20, 31),
    ),
    # Local RoPE base 100 on the sliding layers, linear scaling on the full one; sharded bf16.
    "gemma3": (
        "gemma3",
        {
            "num_hidden_layers": 3,
            "sliding_window": 8,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
        {"max_shard_size": "200KB", "dtype": "bfloat16"},
        128,
        (3, 9, 20, 31),
    ),
    # Qwen3-MoE: q/k norms, renormalized top-k, layer 0 a dense MLP (mlp_only_layers).
    "qwen3moe": ("qwen3moe", {"mlp_only_layers": [0]}, {}, 128, (3, 9, 20, 31)),
}
# Cases served in a pool of this many 4-token blocks (the others: 96), so that requests are
# preempted (recompute) and served again. NOTE: Gemma's mixed layers get the hybrid KV cache,
# whose blocks hold one group's layers (here one layer: 28 hold what ~9 uniform blocks would).
PREEMPT_BLOCKS = {"mixtral": 20, "qwen2moe": 20, "qwen3moe": 20, "gemma2": 28, "gemma3": 28}


def longrope(head_dim: int = 16) -> dict[str, Any]:
    """A LongRoPE config (Phi-3's old name "su") with distinct short and long factors."""
    half = head_dim // 2
    return {
        "type": "su",
        "short_factor": [1.0 + 0.05 * i for i in range(half)],
        "long_factor": [1.5 + 0.4 * i for i in range(half)],
    }


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    return [PREFIX + [40 + 11 * i + 3 * j for j in range(n)] for i, n in enumerate(lengths)]


def _hf_next_token_logprobs(model: Any, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log-probabilities of the token after each prefix of ``prompt + output``
    (row i: after ``prompt + output[:i]``), one teacher-forced forward."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(output) - 1], dim=-1)


@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_transformers(tmp_path: Path, case: str) -> None:
    from transformers import AutoModelForCausalLM

    family, overrides, save, max_model_len, lengths = copy.deepcopy(CASES[case])
    # NOTE: a copy: transformers writes into the rope dict it is given.
    if overrides.get("rope_scaling") == "longrope":
        overrides = {**overrides, "rope_scaling": longrope()}
    model_dir = make_tiny_model(tmp_path, family, **TINY, **overrides, **save)
    if "max_shard_size" in save:
        assert (Path(model_dir) / "model.safetensors.index.json").is_file()
    llm = LLM(
        model_dir,
        dtype="float32",
        quantization="none",
        kernel_selection="off",
        block_size=4,
        num_kv_blocks=PREEMPT_BLOCKS.get(case, 96),
        max_num_batched_tokens=16,
        max_model_len=max_model_len,
    )
    assert llm.engine.arch.architecture == family
    assert llm.engine.arch.sliding_window == overrides.get("sliding_window")
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = _prompts(lengths)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, logprobs=5, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)  # prefix-cache hits this time
    assert llm.stats()["prefix_hit_rate"] > 0
    if case in PREEMPT_BLOCKS:
        assert llm.stats()["preemptions"] > 0
    worst = 0.0
    for prompt, out, out2 in zip(prompts, first, again, strict=True):
        got = out.outputs[0]
        assert list(out2.outputs[0].token_ids) == list(got.token_ids)
        ref_logprobs = _hf_next_token_logprobs(ref, prompt, list(got.token_ids))
        assert list(got.token_ids) == ref_logprobs.argmax(dim=-1).tolist(), len(prompt)
        assert got.logprobs is not None
        for pos, entry in enumerate(got.logprobs):
            assert len(entry) >= 5
            for token_id, lp in entry.items():
                diff = abs(lp.logprob - ref_logprobs[pos][token_id].item())
                worst = max(worst, diff)
                assert diff < ATOL_LOGPROB, (case, len(prompt), pos, token_id, diff)
    print(f"{case}: max |logprob diff| vs transformers {worst:.1e}")
