"""Greedy outputs must not depend on how memory is managed (issue 4's end-to-end checks).

Prefix caching, token budgets, a KV pool so small that requests are preempted (recompute
and swap), and parallel sampling all change *where* KV lives and *when* it is computed;
none may change a single greedy token, in float32 or in bfloat16: batch-invariant numerics
(the default, docs/CONTRACTS.md) give a token's logits the same bits in whatever step computes
it. (Before them a bf16 row's rounding depended on the step it ran in, the kernel chosen for
that M bucket and how the prompt was chunked, and these tests allowed a near-tie.)
"""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.runtime.autotune.candidates import native_bf16
from kvserve.sampling_params import SamplingParams
from tests.e2e.prompts import chat_prompts

MAX_TOKENS = 24
TOP_K = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
# One greedy output: its token ids and, per position, the top-k logprobs (token id -> entry).
Sample = tuple[list[int], list[dict]]


# NOTE: without native bf16 (an AVX2-only CPU) torch emulates bf16 GEMMs, ~80x fp32 at 512
# rows (2.6 s a 512x576x3072 call on the Zen 3 EPYC (AVX2), 2026-12-02), and these tests
# would take most of an hour there; the bf16 path's own tests still run (tests/runtime).
BF16 = pytest.param(
    "bfloat16",
    marks=pytest.mark.skipif(not native_bf16(), reason="bf16 is emulated on this CPU (slow)"),
)


@pytest.fixture(scope="module", params=["float32", BF16])
def dtype(request) -> str:  # type: ignore[no-untyped-def]
    return request.param


@pytest.fixture(scope="module")
def make_llm(dtype, make_llm):  # type: ignore[no-untyped-def]
    """Every engine of a test at one dtype: bf16 runs are compared with bf16 runs."""

    def factory(**kwargs: object) -> object:
        return make_llm(dtype=dtype, **kwargs)

    return factory


def _sample(completion) -> Sample:  # type: ignore[no-untyped-def]
    return list(completion.token_ids), list(completion.logprobs or [])


def _tokens(llm, prompts) -> list[Sample]:
    return [_sample(o.outputs[0]) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def assert_same(got: list[Sample], expected: list[Sample], dtype: str) -> None:
    """``got`` is ``expected``: the same token ids and the same top-k logprobs, bit for bit
    (``dtype`` names the run in a failure)."""
    assert len(got) == len(expected)
    for i, ((g_ids, g_lp), (e_ids, e_lp)) in enumerate(zip(got, expected, strict=True)):
        assert g_ids == e_ids, (dtype, i, g_ids, e_ids)
        assert g_lp == e_lp, (dtype, i)


@pytest.fixture(scope="module")
def reference(make_llm) -> tuple[list[list[int]], list[Sample]]:  # type: ignore[no-untyped-def]
    """Outputs with a roomy pool, prefix cache on, default budget."""
    llm = make_llm(num_kv_blocks=512)
    prompts = chat_prompts(llm.tokenizer)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats()["preemptions"] == 0
    return prompts, [_sample(o.outputs[0]) for o in outs]


def test_prefix_cache_off_is_identical(make_llm, reference, dtype) -> None:
    prompts, expected = reference
    llm = make_llm(num_kv_blocks=512, enable_prefix_caching=False)
    assert_same(_tokens(llm, prompts), expected, dtype)
    assert llm.stats()["prefix_hit_rate"] == 0


def test_prefix_cache_hits_and_is_identical_on_second_pass(make_llm, reference, dtype) -> None:
    prompts, expected = reference
    llm = make_llm(num_kv_blocks=512)
    assert_same(_tokens(llm, prompts), expected, dtype)
    assert_same(_tokens(llm, prompts), expected, dtype)
    assert llm.stats()["prefix_hit_rate"] > 0.4


def test_duplicate_blocks_swapped_for_their_twins_are_identical(make_llm, reference, dtype) -> None:
    """Each prompt twice in one batch: the copies fill the same blocks in the same steps,
    and the later one is swapped for the cached twin (prefix_hits.cache_full_blocks)."""
    prompts, expected = reference
    llm = make_llm(num_kv_blocks=512, max_num_batched_tokens=64)
    assert_same(_tokens(llm, prompts + prompts), expected + expected, dtype)
    stats = llm.stats()
    assert stats["dedup_blocks"] > 0 and stats["kv_usage"] == 0
    llm.engine.kv_cache_manager.check_integrity()


@pytest.mark.parametrize("budget", [16, 64, 2048])
def test_token_budgets_are_identical(make_llm, reference, dtype, budget: int) -> None:
    prompts, expected = reference
    llm = make_llm(num_kv_blocks=512, max_num_batched_tokens=budget)
    assert_same(_tokens(llm, prompts), expected, dtype)


@pytest.mark.parametrize("share", [0.1, 1.0])
def test_prefill_shares_are_identical(make_llm, reference, dtype, share: float) -> None:
    """Fair prefill share (default 0.5 in the reference): a small share, and off (greedy)."""
    prompts, expected = reference
    llm = make_llm(num_kv_blocks=512, max_num_batched_tokens=64, prefill_share=share)
    assert_same(_tokens(llm, prompts), expected, dtype)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_is_identical(make_llm, reference, dtype, mode: str) -> None:
    prompts, expected = reference
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    num_blocks = 2 * (-(-longest // 16)) + 1  # room for about two requests at a time
    llm = make_llm(num_kv_blocks=num_blocks, preemption_mode=mode, max_num_batched_tokens=256)
    assert_same(_tokens(llm, prompts), expected, dtype)
    stats = llm.stats()
    assert stats["preemptions"] > 0
    assert stats["kv_usage"] == 0
    llm.engine.kv_cache_manager.check_integrity()


def test_parallel_sampling_greedy_copies(make_llm, reference, dtype) -> None:
    prompts, expected = reference
    llm = make_llm(num_kv_blocks=512)
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=4, logprobs=TOP_K
    )
    outs = llm.generate(prompts[:2], params, use_tqdm=False)
    for out, exp in zip(outs, expected[:2], strict=True):
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        for c in out.outputs:
            assert_same([_sample(c)], [exp], dtype)
    stats = llm.stats()
    assert stats["fork_shared_blocks"] > 0
    assert stats["kv_usage"] == 0
    llm.engine.kv_cache_manager.check_integrity()


def test_never_fit_requests_are_rejected(make_llm) -> None:
    llm = make_llm(num_kv_blocks=8, max_model_len=256)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 200], SamplingParams(max_tokens=100), use_tqdm=False)
    # 8 blocks x 16 tokens = 128 tokens in the whole pool.
    with pytest.raises(ValueError, match="block"):
        llm.generate([[1] * 100], SamplingParams(max_tokens=100), use_tqdm=False)
    # Nothing was queued and the engine still serves.
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_bad_batch_queues_nothing(make_llm) -> None:
    llm = make_llm(num_kv_blocks=64)
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate(["hello", ""], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 2, 10**9]], SamplingParams(max_tokens=4), use_tqdm=False)


def _staggered_tokens(llm, prompts, every: int = 2) -> list[Sample]:
    """Greedy outputs with one new request every ``every`` steps (prefills beside decodes)."""
    engine = llm.engine
    pending = list(enumerate(prompts))
    finals: dict[str, Sample] = {}
    num_steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and (num_steps % every == 0 or not engine.has_unfinished_requests()):
            i, p = pending.pop(0)
            engine.add_request(p, GREEDY, request_id=f"r{i}")
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = _sample(out.outputs[0])
        num_steps += 1
    return [finals[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("policy", ["shortest", "round-robin", "fcfs"])
def test_step_time_budget_is_identical(make_llm, reference, dtype, policy: str) -> None:
    from kvserve.core.sched.step_budget import StepBudgetConfig, StepTimeBudget

    prompts, expected = reference
    llm = make_llm(num_kv_blocks=512, enable_prefix_caching=False, max_num_batched_tokens=64)
    # NOTE: a target far below any step (every step with decodes gets one minimum chunk),
    # and a fit from the first records on, so the caps act from the second request on.
    cfg = StepBudgetConfig(max_step_ms=1e-3, prefill_policy=policy, min_records=1, skip_first=0)
    llm.engine.scheduler.step_budget = StepTimeBudget(cfg)
    assert_same(_staggered_tokens(llm, prompts), expected, dtype)
    stats = llm.stats()
    assert stats["step_budget_min_chunk_steps"] > 0
    assert stats["kv_usage"] == 0


def test_default_measured_step_budget_is_identical(make_llm, reference, dtype) -> None:
    """Issue 51: the default engine builds the measured step budget; its caps (here its fit
    check made to hold from the first step, and a target below any step: every step with
    decodes gets a minimum chunk) change no token; nor does ``--no-step-budget``."""
    from kvserve.core.sched.measured_budget import MeasuredStepBudget

    prompts, expected = reference
    llm = make_llm(num_kv_blocks=512, enable_prefix_caching=False, max_num_batched_tokens=64)
    default = llm.engine.scheduler.step_budget
    assert isinstance(default, MeasuredStepBudget)
    cfg = dataclasses.replace(default.config, max_step_ms=1e-3, min_records=1, skip_first=0)
    budget = MeasuredStepBudget(cfg, max_error=1e9, min_checked=1)
    llm.engine.scheduler.step_budget = budget
    assert_same(_staggered_tokens(llm, prompts), expected, dtype)
    assert budget.holds and llm.stats()["step_budget_min_chunk_steps"] > 0
    off = make_llm(num_kv_blocks=512, max_num_batched_tokens=64, step_budget=False)
    assert off.engine.scheduler.step_budget is None
    assert_same(_staggered_tokens(off, prompts), expected, dtype)


def test_step_budget_learns_from_every_step(make_llm, reference, dtype) -> None:
    prompts, expected = reference
    llm = make_llm(num_kv_blocks=512, step_budget=True)
    engine = llm.engine
    assert_same(_staggered_tokens(llm, prompts, every=3), expected, dtype)
    budget = engine.scheduler.step_budget
    assert budget is not None
    busy = [r for r in engine.step_records if r["num_seqs"]]
    assert budget.cost.num_observed == len(busy) - budget.config.skip_first
    assert budget.cost.ready
    assert all(r["num_attention_pairs"] >= r["num_context_tokens"] for r in busy)
