"""The memory-management scenarios of test_equivalence.py with quantized weights.

The embedded GGUF runs as stored (``quantization="auto"``: Q4_1 layers, Q8_0 embedding and
lm_head through the int8-dot kernels), compared with itself token for token: prefix caching
off, token budgets, preemption (recompute and swap). Batch-invariant numerics (the default,
docs/CONTRACTS.md) make a token's logits the same bits in every step that computes it: each
projection keeps one row-invariant kernel at every M and every row attends through the paged
decode kernel. (Before them, with chunks on SDPA and the selection free per M, 0-5 of the 6
requests diverged at near-ties and these tests allowed it; tests/e2e/test_batch_invariance.py
draws the formations.)
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from kvserve.models.quant import quantize_dense
from kvserve.runtime.native import quant_ops
from kvserve.sampling_params import SamplingParams
from tests.e2e.prompts import chat_prompts

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def quant_llm(make_llm, **kwargs):  # noqa: ANN001, ANN201 - the session factory and an LLM
    llm = make_llm(quantization="auto", **kwargs)
    formats = llm.stats()["quantization"]["weight_bytes_by_format"]
    assert formats.keys() >= {"q4_1", "q8_0"}
    return llm


@pytest.fixture(scope="module")
def reference(make_llm) -> tuple[list[list[int]], list[list[int]]]:
    llm = quant_llm(make_llm, num_kv_blocks=512)
    prompts = chat_prompts(llm.tokenizer)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats()["preemptions"] == 0
    return prompts, [o.outputs[0].token_ids for o in outs]


def _tokens(llm, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def assert_agrees(got: list[list[int]], expected: list[list[int]]) -> None:
    assert all(len(g) == MAX_TOKENS for g in got)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, (i, g, e)


def test_linear_is_batch_invariant() -> None:
    """A token's output does not depend on the other rows of its batch (bitwise), on every
    instruction set this CPU runs, in both weight layouts and both activation dtypes.

    NOTE: every ISA, not only ``auto``: CI on an AVX2-only CPU caught the AVX2 Q4_1 kernel
    varying with the batch (GCC contracted the min term into an fma for some token counts
    only); on an AVX-512 machine only forcing ``avx2`` / ``avx_vnni`` runs that code.
    """
    assert quant_ops.load(), quant_ops.reason()
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for qtype in ("q4_0", "q4_1", "q8_0"):
        plain = quantize_dense(torch.randn(100, 576, generator=gen), qtype)
        for weight in (plain, plain.interleaved()):
            isas = [
                isa
                for isa in quant_ops.supported_isas()
                if weight.layout == "plain" or isa in quant_ops.X16_ISAS
            ]
            for isa, dtype in itertools.product(isas, (torch.float32, torch.bfloat16)):
                x = torch.randn(9, 576, generator=gen).to(dtype)
                run = functools.partial(
                    quant_ops.linear, weight=weight.data, qtype=qtype, isa=isa, layout=weight.layout
                )
                full = run(x)
                for i in range(9):
                    where = f"{qtype} {weight.layout} {isa} {dtype} row {i}"
                    assert torch.equal(full[i : i + 1], run(x[i : i + 1])), where
                assert torch.equal(full[2:7], run(x[2:7])), f"{qtype} {weight.layout} {isa}"
                checked += 1
    assert checked >= 12  # 3 qtypes x 2 layouts x 2 dtypes with at least the scalar path


def test_prefix_cache_off(make_llm, reference) -> None:
    prompts, expected = reference
    llm = quant_llm(make_llm, num_kv_blocks=512, enable_prefix_caching=False)
    assert_agrees(_tokens(llm, prompts), expected)
    assert llm.stats()["prefix_hit_rate"] == 0


def test_prefix_cache_hits_on_second_pass(make_llm, reference) -> None:
    prompts, expected = reference
    llm = quant_llm(make_llm, num_kv_blocks=512)
    assert_agrees(_tokens(llm, prompts), expected)
    assert_agrees(_tokens(llm, prompts), expected)
    assert llm.stats()["prefix_hit_rate"] > 0.4


@pytest.mark.parametrize("budget", [16, 64, 2048])
def test_token_budgets(make_llm, reference, budget: int) -> None:
    prompts, expected = reference
    llm = quant_llm(make_llm, num_kv_blocks=512, max_num_batched_tokens=budget)
    assert_agrees(_tokens(llm, prompts), expected)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(make_llm, reference, mode: str) -> None:
    prompts, expected = reference
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    num_blocks = 2 * (-(-longest // 16)) + 1  # room for about two requests at a time
    llm = quant_llm(
        make_llm, num_kv_blocks=num_blocks, preemption_mode=mode, max_num_batched_tokens=256
    )
    assert_agrees(_tokens(llm, prompts), expected)
    stats = llm.stats()
    assert stats["preemptions"] > 0
    assert stats["kv_usage"] == 0
    llm.engine.kv_cache_manager.check_integrity()
