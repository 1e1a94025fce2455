"""A model whose layers mix sliding-window and full attention, on the hybrid KV cache.

A tiny random Qwen2 checkpoint (6 layers, 5 sliding to 1 full as Gemma 3 mixes them, window
8 tokens, shorter than every prompt) served through chunked prefill (16-token steps, 4-token
blocks), a pool small enough that long outputs preempt, and, run again, prefix-cache hits.
transformers (fp32, the same weights, its own per-layer sliding masks) is the reference, by
teacher forcing as in ``test_model_families.py``: kvserve's greedy tokens must be its argmax at
every position and each top-5 log-probability within 1e-4 of its own.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.core.kv.hybrid import HybridKVCacheManager
from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.e2e.test_model_families import ATOL_LOGPROB, TINY, _hf_next_token_logprobs
from tests.tiny_models import make_tiny_model

SLIDE, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = [SLIDE, SLIDE, FULL, SLIDE, SLIDE, SLIDE]
PREFIX = [300 + 7 * j for j in range(12)]


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(
        tmp_path_factory.mktemp("hybrid"),
        "qwen2",
        **TINY,
        num_hidden_layers=6,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=0,
        layer_types=LAYER_TYPES,
    )


def _llm(model: str, **engine: object) -> LLM:
    """The dense fp32 engine of these checks: 4-token blocks, a 64-block pool."""
    return LLM(
        model,
        dtype="float32",
        quantization="none",
        kernel_selection="off",
        block_size=4,
        num_kv_blocks=64,
        max_model_len=128,
        **engine,  # type: ignore[arg-type]
    )


def test_hybrid_model_matches_transformers(hybrid_model: str) -> None:
    from transformers import AutoModelForCausalLM

    llm = _llm(hybrid_model, max_num_batched_tokens=16)
    engine = llm.engine
    assert engine.arch.layer_types == tuple(LAYER_TYPES)
    kv = engine.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager)
    # 6 groups of one layer (full first): a block id holds one layer's K/V.
    assert [g.window for g in kv.groups] == [None] + [8] * 5
    assert engine.runner.kv_cache.num_layers == 1
    ref = AutoModelForCausalLM.from_pretrained(hybrid_model, dtype=torch.float32).eval()
    prompts = [
        PREFIX + [40 + 11 * i + 3 * j for j in range(n)] for i, n in enumerate((9, 20, 31, 14))
    ]
    params = SamplingParams(temperature=0.0, max_tokens=48, logprobs=5, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)  # prefix-cache hits this time
    stats = llm.stats()
    assert stats["prefix_hit_rate"] > 0
    assert stats["preemptions"] > 0
    assert stats["window_freed_blocks"] > 0
    kv.check_integrity()
    worst = 0.0
    for prompt, out, out2 in zip(prompts, first, again, strict=True):
        got = out.outputs[0]
        assert list(out2.outputs[0].token_ids) == list(got.token_ids)
        ref_logprobs = _hf_next_token_logprobs(ref, prompt, list(got.token_ids))
        assert list(got.token_ids) == ref_logprobs.argmax(dim=-1).tolist(), len(prompt)
        assert got.logprobs is not None
        for pos, entry in enumerate(got.logprobs):
            for token_id, lp in entry.items():
                diff = abs(lp.logprob - ref_logprobs[pos][token_id].item())
                worst = max(worst, diff)
                assert diff < ATOL_LOGPROB, (len(prompt), pos, token_id, diff)
    print(f"hybrid qwen2: max |logprob diff| vs transformers {worst:.1e}")


def test_hybrid_rejects_what_it_cannot_run(hybrid_model: str) -> None:
    with pytest.raises(ValueError, match="kv_window"):
        LLM(hybrid_model, kv_window=16, quantization="none", kernel_selection="off")


def test_memory_report_counts_blocks_per_group() -> None:
    from kvserve.core.kv.kv_groups import group_layers
    from kvserve.engine.memory_budget import MemoryReport

    groups = group_layers([SLIDE] * 5 + [FULL], 64)
    base = dict(weights_bytes=0, activation_bytes=0, headroom_bytes=0, kv_bytes_per_token=1)
    uniform = MemoryReport(
        **base,
        block_size=16,
        num_kv_blocks=512,
        num_host_blocks=0,
        max_model_len=2048,
        budget_bytes=None,
    )
    hybrid = MemoryReport(
        **base,
        block_size=16,
        num_kv_blocks=3072,
        num_host_blocks=0,
        max_model_len=2048,
        budget_bytes=None,
        kv_groups=groups,
        max_chunk=512,
    )
    assert uniform.max_concurrent_requests(1024) == 8
    # 64 full blocks + 5 sliding groups x (ceil(64 / 16) + 1); one 512-token chunk's
    # sliding blocks (5 x (37 - 5)) kept free: (3072 - 160) // 89.
    assert hybrid.max_concurrent_requests(1024) == 32
    # One request alone: the sliding groups' chunk-time bound, the rest to the full group.
    assert hybrid.max_tokens_in_cache == (3072 - 5 * 37) * 16


def test_budget_holds_one_max_length_request_per_group() -> None:
    from kvserve.config import ModelArchConfig
    from kvserve.core.kv.kv_groups import group_layers
    from kvserve.engine.config import EngineConfig
    from kvserve.engine.memory_budget import HEADROOM_BYTES, MemoryBudgetError, plan_kv_blocks

    arch = ModelArchConfig("qwen2", 512, 64, 128, 6, 4, 2, 16, 2048, sliding_window=64)
    groups = group_layers([SLIDE] * 5 + [FULL], 64)
    per_token = 256  # one layer's K and V per block id: 2 x 2 heads x 16 x 4 bytes
    # One 2,048-token request needs 128 full blocks + 5 x window_blocks(64, 16, 512) = 313
    # block ids: a budget with room for 200 fails, where a single-table count (128) fit.
    budget = HEADROOM_BYTES + (1 << 20) + 200 * 16 * per_token

    def plan(kv_groups):  # type: ignore[no-untyped-def]
        return plan_kv_blocks(
            EngineConfig(memory_budget=budget),
            arch,
            weights_bytes=1 << 20,
            kv_bytes_per_token=per_token,
            max_model_len=2048,
            activation_bytes=0,
            kv_groups=kv_groups,
        )

    assert plan(None).num_kv_blocks == 200
    with pytest.raises(MemoryBudgetError, match="request's KV"):
        plan(groups)


def test_input_batch_gives_each_layer_its_groups_metadata() -> None:
    from kvserve.core.kv.kv_groups import group_layers
    from kvserve.core.outputs import ScheduledRequest, SchedulerOutput
    from kvserve.runtime.input_batch import build_input_batch

    groups = group_layers(LAYER_TYPES, 8)  # full group (2,), sliding (0,), (1,), (3,) ...
    # Position 13 reads 6..13 in a sliding layer: block 0 (0..3) left the window.
    tables = [[0, 1, 2, 3], *([-1, 4 + 3 * g, 5 + 3 * g, 6 + 3 * g] for g in range(5))]
    sr = ScheduledRequest("r", [5], 13, tables[0], True, SamplingParams(), [1] * 13, [])
    sched = SchedulerOutput(scheduled=[sr])
    kw = dict(block_size=4, num_blocks=20, device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(ValueError, match="a block table per KV cache group"):
        build_input_batch(sched, kv_groups=groups, **kw)
    sr.group_block_ids = tables
    meta = build_input_batch(sched, kv_groups=groups, **kw).attn_meta
    assert meta.layer_metas is not None and len(meta.layer_metas) == 6
    for g, spec in enumerate(groups):
        for layer in spec.layers:
            m = meta.layer_metas[layer]
            assert m.sliding_window == spec.window and m.seqs[0].block_ids == tables[g]
            assert m.slot_mapping.tolist() == [tables[g][3] * 4 + 1]  # position 13


def test_teacher_forced_accuracy_pass_reads_each_groups_table(hybrid_model: str) -> None:
    """``kvserve bench accuracy``'s teacher-forced pass on a hybrid cache: each group gets its
    own block ids, and every position's log-probabilities match transformers'."""
    from transformers import AutoModelForCausalLM

    from kvserve.bench.accuracy import teacher_forced

    llm = _llm(hybrid_model)
    tokens = PREFIX + [40 + 5 * j for j in range(28)]  # 40 tokens: 10 blocks in each of 6 groups
    forced = teacher_forced(llm.engine.runner, tokens, 16, keep_logprobs=True)
    got = torch.cat(forced.logprobs or [])
    ref = AutoModelForCausalLM.from_pretrained(hybrid_model, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([tokens])).logits[0, :-1].float(), dim=-1)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < ATOL_LOGPROB
