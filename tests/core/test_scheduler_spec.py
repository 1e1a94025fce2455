"""Speculative decoding in the scheduler and the KV manager (core/sched/speculate.py).

Over the FakeRunner (tests/core/fake_runner.py): every step checks the manager's integrity
and every slot a request reads, so a draft's K/V left where a verified token's belongs, a
block of rejected drafts kept or a draft in the prefix cache shows up as a wrong read or an
integrity error. Greedy output must be exactly what plain decoding gives.
"""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.errors import IntegrityError
from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.sched.scheduler import Scheduler
from kvserve.core.sched.speculate import (
    SpecDecodeStats,
    Speculator,
    expected_gain,
    propose_ngram,
)
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.spec_config import SpeculativeConfig
from tests.core.fake_runner import Driver, FakeClock, assert_pool_idle, make_request
from tests.core.sched_helpers import VOCAB, assert_expected, prompt
from tests.core.spec_helpers import DraftModelFakeRunner, OracleSpeculator, SpecFakeRunner


def make_spec_driver(
    good: object = lambda r: 2,
    *,
    num_blocks: int = 32,
    block_size: int = 4,
    num_host_blocks: int = 0,
    spec: dict | None = None,
    **config: object,
) -> tuple[Driver, OracleSpeculator]:
    settings: dict = dict(
        max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256, admission_headroom=0.0
    )
    settings.update(config)
    settings.setdefault("resume_watermark", settings["admission_headroom"])
    kv = KVCacheManager(num_blocks, block_size, num_host_blocks=num_host_blocks)
    spec_config = SpeculativeConfig(
        **{"num_speculative_tokens": 3, "disable_by_batch_size": 64, **(spec or {})}
    )
    speculator = OracleSpeculator(
        spec_config, settings["max_model_len"], vocab_size=VOCAB, good=good
    )  # type: ignore[arg-type]
    clock = FakeClock()
    scheduler = Scheduler(SchedulerConfig(**settings), kv, clock=clock, speculator=speculator)
    runner = SpecFakeRunner(num_blocks, block_size, num_host_blocks, VOCAB)
    return Driver(scheduler, runner, clock), speculator


# ---------------------------------------------------------------------- the KV manager


def test_release_rejected_frees_exactly_the_blocks_of_rejected_drafts() -> None:
    kv = KVCacheManager(8, 4)
    req = Request("a", list(range(1, 7)), SamplingParams(max_tokens=None))
    assert kv.allocate_slots(req, 6) == [0, 1]
    req.num_computed_tokens = 6
    req.output_token_ids.append(9)  # 7 tokens, 6 computed: a decode
    # The known token at position 6 plus 5 drafts (positions 7..11): blocks 1 and 2.
    assert kv.allocate_slots(req, 6) == [2]
    kv.set_lookahead(req, 5)
    kv.check_integrity()
    assert kv.get_block_ids("a") == [0, 1, 2]
    # One draft accepted: positions 0..7 hold verified K/V, block 2 held only rejected ones.
    assert kv.release_rejected(req, 8) == [2]
    assert kv.get_block_ids("a") == [0, 1]
    assert kv.block_pool.blocks[2].ref_cnt == 0 and kv.num_free_blocks == 6
    kv.check_integrity()
    # Only full blocks of the request's own (verified) tokens are cached: block 0.
    assert [b.block_id for b in kv.block_pool.blocks if b.is_cached] == [0]


def test_drafts_never_reach_the_prefix_cache() -> None:
    kv = KVCacheManager(8, 4)
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=None))
    kv.allocate_slots(req, 3)
    req.num_computed_tokens = 3
    req.output_token_ids.append(4)  # position 3: the block fills with the drafts
    assert kv.allocate_slots(req, 1 + 4) == [1]  # token 4 and drafts at positions 4..7
    kv.set_lookahead(req, 4)
    cached = [b.block_id for b in kv.block_pool.blocks if b.is_cached]
    assert cached == [0]  # block 0 holds known tokens 1, 2, 3, 4; block 1 only drafts
    kv.check_integrity()
    assert kv.release_rejected(req, 4) == [1]
    kv.free(req)
    assert kv.num_free_blocks == 8


def test_integrity_catches_a_table_past_its_lookahead() -> None:
    kv = KVCacheManager(8, 4)
    req = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=None))
    kv.allocate_slots(req, 5 + 8)  # as if 8 lookahead slots ...
    kv.set_lookahead(req, 2)  # ... but only 2 recorded
    with pytest.raises(IntegrityError, match="lookahead"):
        kv.check_integrity()


# ---------------------------------------------------------------------- the n-gram proposer


def test_propose_ngram_takes_the_latest_longest_match() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # "1 2 3" occurs at 0 (followed by 4 5 9); "2 3" later at 6 (7 8), but longest first.
    assert propose_ngram(tokens, 1, 3, 3) == [4, 5, 9]
    assert propose_ngram(tokens, 1, 2, 3) == [7, 8, 1]  # latest "2 3"
    assert propose_ngram([5, 6, 7], 1, 3, 2) == []
    assert propose_ngram([7, 7, 7, 7], 2, 2, 4) == [7]  # the match may run into the tail
    # Misaligned byte matches are not token matches.
    assert propose_ngram([256, 1, 0, 0, 1], 1, 1, 2) == [0, 0]


def test_cost_model_drafts_more_with_acceptance_and_none_past_the_batch_limit() -> None:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=8, disable_by_batch_size=4), 999)
    req = Request("a", [1], SamplingParams())
    req.spec_accepted, req.spec_tested = 0.0, 20.0  # never accepted
    assert spec.num_to_draft(req, 1, 8) == 0
    req.spec_accepted, req.spec_tested = 19.0, 20.0
    assert spec.num_to_draft(req, 1, 8) == 8
    assert 0 < spec.num_to_draft(req, 3, 8) < 8  # costlier tokens in a bigger batch
    assert spec.num_to_draft(req, 4, 8) == 0
    assert expected_gain(0.0, 3, 0.2) < 1.0 < expected_gain(0.9, 3, 0.2)


def test_stats_follow_vllm_names() -> None:
    s = SpecDecodeStats()
    s.observe(3, 2)
    s.observe(2, 0)
    d = s.as_dict()
    assert d["spec_decode_num_drafts"] == 2
    assert d["spec_decode_num_draft_tokens"] == 5
    assert d["spec_decode_num_accepted_tokens"] == 2
    assert d["spec_decode_acceptance_rate"] == pytest.approx(0.4)
    assert d["spec_decode_mean_acceptance_length"] == pytest.approx(2.0)
    assert [d[f"spec_decode_num_accepted_tokens_per_pos_{i}"] for i in range(3)] == [1, 1, 0]


# ---------------------------------------------------------------------- the scheduler


@pytest.mark.parametrize("good", [0, 1, 3])
def test_greedy_output_is_plain_decoding_with_prefix_caching(good: int) -> None:
    d, spec = make_spec_driver(lambda r: good, spec={"adaptive": False})
    reqs = [make_request(f"r{i}", prompt(9, base=i % 2), max_tokens=20) for i in range(4)]
    for r in reqs:
        d.scheduler.add_request(r)
    d.run()
    assert_expected(d, *reqs)
    assert_pool_idle(d.scheduler.kv)
    stats = d.scheduler.stats()
    assert stats["spec_decode_num_drafts"] > 0
    # good right drafts a proposal (fewer where max_tokens cuts it): that many accepted.
    expect = {0: 0, 1: stats["spec_decode_num_drafts"], 3: stats["spec_decode_num_draft_tokens"]}
    assert stats["spec_decode_num_accepted_tokens"] == expect[good]
    assert stats["prefix_cache_hits"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_speculation_survives_preemption(mode: str) -> None:
    d, _ = make_spec_driver(
        lambda r: r.num_output_tokens % 3,
        num_blocks=9,
        num_host_blocks=16,
        preemption_mode=mode,
        spec={"adaptive": False, "num_speculative_tokens": 4},
    )
    reqs = [make_request(f"r{i}", prompt(7, base=i), max_tokens=18) for i in range(3)]
    for r in reqs:
        d.scheduler.add_request(r)
    d.run()
    assert d.scheduler.totals.preemptions > 0
    assert_expected(d, *reqs)
    assert_pool_idle(d.scheduler.kv)


def test_budget_counts_drafts_and_drafts_stop_at_max_tokens() -> None:
    d, _ = make_spec_driver(lambda r: 3, max_num_batched_tokens=6, spec={"adaptive": False})
    reqs = [make_request(f"r{i}", prompt(4, base=i), max_tokens=7) for i in range(3)]
    for r in reqs:
        d.scheduler.add_request(r)
    d.run()
    assert_expected(d, *reqs)
    spec_steps = [o for o in d.outputs if any(sr.spec_token_ids for sr in o.scheduled)]
    assert spec_steps
    for o in d.outputs:  # the Driver checks the budget; drafts are in the count
        assert o.total_num_scheduled_tokens <= 6
    for r in reqs:
        assert r.num_output_tokens == 7  # never past max_tokens


def test_a_stop_token_among_accepted_drafts_ends_the_request_there() -> None:
    d, _ = make_spec_driver(lambda r: 3, spec={"adaptive": False})
    probe = make_request("probe", prompt(5), max_tokens=12)
    d.scheduler.add_request(probe)
    d.run()
    stop = probe.output_token_ids[5]
    d2, _ = make_spec_driver(lambda r: 3, spec={"adaptive": False})
    req = make_request("a", prompt(5), max_tokens=12, stop_token_ids=[stop])
    d2.scheduler.add_request(req)
    d2.run()
    assert req.output_token_ids == probe.output_token_ids[: probe.output_token_ids.index(stop) + 1]
    assert_pool_idle(d2.scheduler.kv)


def test_acceptance_adapts_the_draft_length() -> None:
    d, spec = make_spec_driver(lambda r: 0, spec={"num_speculative_tokens": 4})
    req = make_request("a", prompt(6), max_tokens=60)
    d.scheduler.add_request(req)
    d.run()
    assert_expected(d, req)
    lengths = [len(sr.spec_token_ids) for o in d.outputs for sr in o.scheduled]
    # Nothing is ever accepted: the request soon stops drafting, trying again now and then.
    assert sum(1 for k in lengths if k) < len(lengths) // 3
    assert any(lengths[len(lengths) // 2 :])


def test_no_drafts_past_disable_by_batch_size() -> None:
    d, spec = make_spec_driver(lambda r: 3, spec={"disable_by_batch_size": 2, "adaptive": False})
    reqs = [make_request(f"r{i}", prompt(4, base=i), max_tokens=6 + 8 * i) for i in range(3)]
    for r in reqs:
        d.scheduler.add_request(r)
    d.run()
    assert_expected(d, *reqs)
    alone = 0
    for o in d.outputs:
        if sum(1 for sr in o.scheduled if sr.sample) >= 2:
            assert not any(sr.spec_token_ids for sr in o.scheduled)
        else:
            alone += 1
    # No lookup either while the batch is past the limit (it reads all of a request's tokens).
    assert 0 < spec.proposed <= alone


def test_no_drafts_for_requests_with_logprobs() -> None:
    d, spec = make_spec_driver(lambda r: 3, spec={"adaptive": False})
    req = make_request("a", prompt(4), max_tokens=6, logprobs=1)
    d.scheduler.add_request(req)
    d.run()
    assert spec.proposed == 0


# ---------------------------------------------------------------------- the config


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"method": "medusa"}, "method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "draft_model"}, "model"),
        ({"num_speculative_token": 3}, "num_speculative_token"),
        ("{not json", "JSON"),
    ],
)
def test_bad_config_names_the_field(value: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(value)


def test_config_as_vllm_takes_it() -> None:
    c = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'
    )
    assert c is not None and (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    d = SpeculativeConfig.parse({"model": "/x/draft.gguf", "num_speculative_tokens": 2})
    assert d is not None and d.method == "draft_model"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_draft_model_placeholders_are_filled_by_the_runner(mode: str) -> None:
    """A draft model: the scheduler drafts placeholders, the runner's drafts are verified."""
    settings = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256)
    kv = KVCacheManager(10, 4, num_host_blocks=16)
    spec = SpeculativeConfig.parse(
        {"model": "/x/draft", "num_speculative_tokens": 3, "adaptive": False}
    )
    assert spec is not None
    assert spec.method == "draft_model" and spec.draft_token_cost is None
    clock = FakeClock()
    config = SchedulerConfig(
        **settings, admission_headroom=0.0, resume_watermark=0.0, preemption_mode=mode
    )
    scheduler = Scheduler(config, kv, clock=clock, speculator=Speculator(spec, 256))
    runner = DraftModelFakeRunner(10, 4, 16, VOCAB, good=lambda rid, n: n % 4)
    d = Driver(scheduler, runner, clock)
    reqs = [make_request(f"r{i}", prompt(7, base=i % 2), max_tokens=18) for i in range(3)]
    for r in reqs:
        scheduler.add_request(r)
    d.run()
    assert_expected(d, *reqs)  # the fake model's own tokens: no placeholder, no wrong draft
    assert_pool_idle(kv)
    stats = scheduler.stats()
    assert runner.filled == stats["spec_decode_num_drafts"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0
