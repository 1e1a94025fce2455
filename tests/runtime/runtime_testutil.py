"""Helpers for runtime tests: tiny random HF models and a toy block allocator."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
import transformers

from kvserve.config import ModelArchConfig
from kvserve.core.outputs import ScheduledRequest, SchedulerOutput
from kvserve.models.hf_loader import hf_arch_config
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.weights import split_fused
from kvserve.runtime.model_runner import ModelRunner
from kvserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    # NOTE: larger than HF's 0.02 so attention is far from uniform and logits spread out.
    initializer_range=0.2,
)


def tiny_hf_model(kind: str, **overrides: object) -> transformers.PreTrainedModel:
    """A tiny random float32 HF model: kind in {'llama', 'qwen2', 'mistral', 'qwen3',
    'phi3', 'gemma2', 'gemma3'}."""
    torch.manual_seed(1234)
    if kind == "llama":  # GQA 4:2, untied, llama3 rope scaling
        cfg = transformers.LlamaConfig(
            **TINY,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=5000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    elif kind == "qwen2":  # q/k/v bias, tied embeddings, MHA
        cfg = transformers.Qwen2Config(
            **TINY, num_key_value_heads=4, tie_word_embeddings=True, rope_theta=1e6
        )
    elif kind == "mistral":  # MQA, explicit head_dim != hidden / heads
        cfg = transformers.MistralConfig(
            **TINY, num_key_value_heads=1, head_dim=24, sliding_window=None
        )
    elif kind == "qwen3":  # q/k norms, GQA 4:2, yarn rope scaling
        cfg = transformers.Qwen3Config(
            **TINY,
            num_key_value_heads=2,
            head_dim=16,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        )
    elif kind == "phi3":  # fused qkv / gate_up, LongRoPE (short factors) with attention scaling
        cfg = transformers.Phi3Config(
            **TINY,
            num_key_value_heads=2,
            original_max_position_embeddings=TINY["max_position_embeddings"],
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
                "attention_factor": 1.2,
            },
            pad_token_id=0,
        )
    elif kind in ("gemma2", "gemma3"):  # sliding then full layer (window 6), scale 24 ** -0.5
        gemma = dict(
            **TINY,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=6,
            query_pre_attn_scalar=24,
            pad_token_id=0,
        )
        if kind == "gemma2":  # soft caps that bite at these magnitudes
            cfg = transformers.Gemma2Config(
                **gemma, attn_logit_softcapping=3.0, final_logit_softcapping=10.0
            )
        else:  # q/k norms, local RoPE base 100, linear scaling on the full layer
            cfg = transformers.Gemma3TextConfig(
                **gemma,
                sliding_window_pattern=2,
                rope_local_base_freq=100.0,
                rope_scaling={"rope_type": "linear", "factor": 2.0},
            )
    else:
        raise ValueError(kind)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # make biases (and Gemma's zero-initialised norms) non-zero
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif kind.startswith("gemma") and name.endswith("norm.weight"):
                p.normal_(0, 0.2)
    return model.eval()


def ours_from_hf(
    hf_model: transformers.PreTrainedModel,
    attn_backend: str = "torch_sdpa",
    native_ops: bool | None = None,
) -> tuple[LlamaForCausalLM, ModelArchConfig]:
    """Our model with the HF model's weights, and its arch config.

    ``native_ops`` None: the native CPU kernels where they load (the engine's default).
    """
    arch = hf_arch_config(hf_model.config.to_dict(), "tiny")
    model = LlamaForCausalLM(arch, attn_backend=attn_backend, native_ops=native_ops)
    model.load_weights(split_fused(hf_model.state_dict(), arch))
    return model, arch


@torch.no_grad()
def hf_logits(hf_model: transformers.PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] float32 logits of the HF model over one whole sequence."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()


@dataclass
class ToyAllocator:
    """Hands out distinct, shuffled block ids so block tables are non-contiguous."""

    num_blocks: int
    block_size: int
    seed: int = 0
    free: list[int] = field(default_factory=list)
    tables: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self.free)

    def ensure(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow ``request_id``'s table to hold ``num_tokens``; returns the table."""
        table = self.tables.setdefault(request_id, [])
        while len(table) * self.block_size < num_tokens:
            table.append(self.free.pop())
        return table


def sched_req(
    request_id: str,
    tokens: list[int],
    start: int,
    end: int,
    block_ids: list[int],
    sample: bool,
    params: SamplingParams = GREEDY,
) -> ScheduledRequest:
    """ScheduledRequest computing ``tokens[start:end]`` (prompt := tokens[:end])."""
    return ScheduledRequest(
        request_id=request_id,
        token_ids=tokens[start:end],
        start_pos=start,
        block_ids=list(block_ids),
        sample=sample,
        sampling_params=params,
        prompt_token_ids=tokens,
        output_token_ids=[],
    )


def generate(
    runner: ModelRunner,
    prompts: dict[str, list[int]],
    num_new_tokens: int,
    *,
    token_budget: int = 1 << 30,
    alloc: ToyAllocator | None = None,
    params: SamplingParams = GREEDY,
) -> dict[str, list[int]]:
    """A miniature continuous-batching loop: each step, running sequences decode one token
    and unfinished prompts take prefill chunks under ``token_budget``. Returns new tokens."""
    alloc = alloc or ToyAllocator(runner.num_blocks, runner.block_size)
    tokens = {rid: list(p) for rid, p in prompts.items()}
    computed = dict.fromkeys(prompts, 0)
    new: dict[str, list[int]] = {rid: [] for rid in prompts}
    while any(len(v) < num_new_tokens for v in new.values()):
        budget = token_budget
        scheduled = []
        # decodes first (they have exactly one token left), then prefill chunks
        for rid in sorted(tokens, key=lambda r: len(tokens[r]) - computed[r] != 1):
            left = len(tokens[rid]) - computed[rid]
            if len(new[rid]) >= num_new_tokens or budget == 0:
                continue
            n = min(left, budget)
            end = computed[rid] + n
            table = alloc.ensure(rid, end)
            req = sched_req(rid, tokens[rid], computed[rid], end, table, end == len(tokens[rid]))
            req.sampling_params = params
            scheduled.append(req)
            budget -= n
        out = runner.execute(SchedulerOutput(scheduled=scheduled))
        for req in scheduled:
            computed[req.request_id] += req.num_tokens
            if req.sample:
                tok = out.sampled_token_ids[req.request_id]
                tokens[req.request_id].append(tok)
                new[req.request_id].append(tok)
    return new


def hf_greedy(hf_model: transformers.PreTrainedModel, prompt: list[int], num: int) -> list[int]:
    """Greedy continuation by repeated full HF forwards (argmax of the last position)."""
    tokens = list(prompt)
    for _ in range(num):
        tokens.append(int(hf_logits(hf_model, tokens)[-1].argmax()))
    return tokens[len(prompt) :]
