"""The measured price of a draft position (``core/sched/draft_price.py``): from one-request
steps only, medians, the prior until measured, and the speculator drafting by it."""

from __future__ import annotations

import pytest

from kvserve.core.sched.draft_price import MeasuredDraftPrice
from kvserve.core.sched.speculate import Speculator
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.spec_config import DEFAULT_DRAFT_TOKEN_COST, SpeculativeConfig


def _record(seconds: float, *, seqs: int = 1, decode: int = 1, drafts: int = 0) -> dict:
    """A step record as ``step_cost.step_record`` writes it: a verification's 1 + k positions
    are prefill tokens, its k drafts ``num_spec_tokens``."""
    return {
        "num_prefill_tokens": drafts + 1 if drafts else 0,
        "num_decode_tokens": 0 if drafts else decode,
        "num_spec_tokens": drafts,
        "num_seqs": seqs,
        "seconds": seconds,
    }


def _feed(price: MeasuredDraftPrice, decode_s: float, per_position_s: float, n: int) -> None:
    for _ in range(n):
        price.observe(_record(decode_s))
        price.observe(_record(decode_s + 4 * per_position_s, drafts=4))


def test_the_prior_until_both_kinds_are_seen_then_the_ratio() -> None:
    price = MeasuredDraftPrice(0.15, min_samples=3)
    _feed(price, 0.006, 0.0015, 2)
    assert not price.measured and price.cost() == 0.15
    _feed(price, 0.006, 0.0015, 1)
    assert price.measured and price.cost() == pytest.approx(0.25)


def test_only_one_request_steps_count() -> None:
    price = MeasuredDraftPrice(0.15, min_samples=1)
    price.observe(_record(0.020, seqs=4, decode=4))  # a batch: its time is not batch 1's
    price.observe(_record(0.050, seqs=2, drafts=4))
    price.observe({**_record(0.030), "num_prefill_tokens": 40, "num_decode_tokens": 0})
    assert not price.measured
    price.observe(_record(0.010, drafts=2))  # no decode time yet to subtract: skipped
    assert not price.measured
    _feed(price, 0.004, 0.0002, 1)
    assert price.cost() == pytest.approx(0.05)


def test_medians_shrug_off_a_stretched_step() -> None:
    price = MeasuredDraftPrice(0.15, min_samples=5)
    _feed(price, 0.005, 0.001, 9)
    price.observe(_record(0.5))  # a page fault or another process: 100x
    price.observe(_record(0.005 + 4 * 0.001, drafts=4))  # against the stretched decode: < 0
    assert price.cost() == pytest.approx(0.2)


def test_clamped_to_one() -> None:
    price = MeasuredDraftPrice(0.15, min_samples=1)
    _feed(price, 0.001, 0.01, 1)  # each draft costs 10 decode steps
    assert price.cost() == 1.0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="prior"):
        MeasuredDraftPrice(1.5)
    with pytest.raises(ValueError, match="min_samples"):
        MeasuredDraftPrice(0.15, window=4, min_samples=5)


def test_the_speculator_drafts_by_the_measured_price() -> None:
    """At an acceptance of 0.5, two drafts pay at the prior price (0.15 of a decode) and none
    at a measured 0.6; a price the config sets is not measured."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), 999)
    assert spec.config.draft_token_cost is None and spec.price is not None
    req = Request("a", [1], SamplingParams())
    req.spec_accepted, req.spec_tested = 10.0, 20.0
    assert spec.draft_token_cost(1) == DEFAULT_DRAFT_TOKEN_COST
    assert spec.num_to_draft(req, 1, 4) > 0
    for _ in range(spec.price.min_samples):
        spec.observe(_record(0.005))
        spec.observe(_record(0.005 + 4 * 0.003, drafts=4))
    assert spec.draft_token_cost(1) == pytest.approx(0.6)
    assert spec.num_to_draft(req, 1, 4) == 0
    fixed = Speculator(SpeculativeConfig(num_speculative_tokens=4, draft_token_cost=0.3), 999)
    assert fixed.price is None
    fixed.observe(_record(0.005))
    assert fixed.draft_token_cost(1) == 0.3
