"""The step budget's ITL tail allowance: a bucket of decode tokens that uncapped steps spend."""

from __future__ import annotations

import pytest

from kvserve.core.sched.step_budget import PrefillCandidate, StepBudgetConfig, StepTimeBudget
from kvserve.engine.config import EngineConfig
from tests.core.fake_runner import make_request
from tests.core.test_step_budget import FakeCost, layout, make, prompt


def budget(**cfg: object) -> StepTimeBudget:
    cfg.setdefault("max_step_ms", 30.0)
    cfg.setdefault("ttft_aging", 0.0)
    return StepTimeBudget(StepBudgetConfig(**cfg), FakeCost())  # type: ignore[arg-type]


def record(num_decodes: int, num_prefill: int = 0) -> dict[str, float]:
    return {
        "seconds": 0.01,
        "num_decode_tokens": num_decodes,
        "num_prefill_tokens": num_prefill,
        "num_context_tokens": 10 * num_decodes + num_prefill,
        "num_seqs": num_decodes + (num_prefill > 0),
    }


LONG = PrefillCandidate("L", 0, 100, waiting=True)


def earned(b: StepTimeBudget, num_decodes: int) -> StepTimeBudget:
    """``b`` after executing ``num_decodes`` decode tokens (in steps of 100)."""
    while num_decodes > 0:
        b.observe(record(min(num_decodes, 100)))
        num_decodes -= 100
    return b


def test_the_allowance_starts_empty_and_is_earned_by_executed_decodes() -> None:
    b = budget(tail_fraction=0.01, tail_window=300)
    assert b.tail_credit == 0.0
    assert b.plan([5], [LONG], 64) == {"L": 19}  # nothing earned yet: capped at 30 ms
    b.observe(record(50))  # +0.5
    b.observe(record(40, 20))  # +0.4: prefill tokens add nothing
    assert b.tail_credit == pytest.approx(0.9)
    assert b.plan([5], [LONG], 64) == {"L": 19}  # 0.9 < 1 decode
    earned(b, 1000)
    assert b.tail_credit == pytest.approx(3.0)  # capped at 0.01 x 300


def test_each_uncapped_step_spends_its_decodes() -> None:
    b = earned(budget(tail_fraction=0.01, tail_window=300), 300)  # 3 decode tokens
    assert b.plan([5, 5], [LONG], 64) is None  # uncapped: the token budget alone
    assert b.tail_credit == pytest.approx(1.0)
    # 1 token left < 2 decodes: capped at the 30 ms target (10 + 2 + 18).
    assert b.plan([5, 5], [LONG], 64) == {"L": 18}
    stats = b.stats()
    assert stats["step_budget_tail_steps"] == 1
    assert stats["step_budget_capped_steps"] == 1
    assert stats["step_budget_tail_credit"] == pytest.approx(1.0)


def test_short_prompts_and_steps_that_fit_do_not_spend_it() -> None:
    b = earned(budget(tail_fraction=0.01, tail_window=300, tail_min_tokens=64), 300)
    short = PrefillCandidate("S", 0, 40, waiting=True)
    assert b.plan([5], [short], 64) == {"S": 19}  # cut, but 40 < 64 tokens: split
    assert b.plan([5], [PrefillCandidate("F", 0, 12)], 64) == {"F": 12}  # fits the target
    assert b.tail_credit == pytest.approx(3.0)
    # A long prompt behind the short one: the step goes uncapped for it.
    assert b.plan([5], [short, LONG], 64) is None
    assert b.tail_credit == pytest.approx(2.0)


def test_without_a_fraction_nothing_is_uncapped() -> None:
    b = budget()
    assert b.plan([5], [LONG], 64) == {"L": 19}
    assert b.stats()["step_budget_tail_steps"] == 0


def test_in_the_scheduler_a_long_prompt_goes_unsplit_while_the_allowance_lasts() -> None:
    # Room for one uncapped step beside one decode, earned by 100 executed decodes.
    # NOTE: prefill_share 1: the uncapped step is the greedy token budget's (the fair share
    # would split it between A and B; that rule: test_scheduler_fair_prefill.py).
    d = make(budget=64, tail_fraction=0.01, tail_window=100, prefill_share=1.0)
    assert d.scheduler.step_budget is not None
    earned(d.scheduler.step_budget, 100)
    d.scheduler.add_request(make_request("D", prompt(8, 1), max_tokens=40))
    d.step()  # D's prefill alone (no decodes: uncapped anyway)
    d.scheduler.add_request(make_request("A", prompt(80, 2), max_tokens=2))
    d.scheduler.add_request(make_request("B", prompt(80, 3), max_tokens=2))
    # A: the token budget beside D's decode (63 tokens), spending the whole allowance.
    assert layout(d.step()[0]) == [("D", 1), ("A", 63)]
    # A's rest (17 tokens) fits the target; B takes what is left of it (30 - 10 - 1 - 17 = 2)
    # and from then on is split: 30 ms steps (10 ms + decodes + chunk).
    assert layout(d.step()[0]) == [("D", 1), ("A", 17), ("B", 2)]
    assert layout(d.step()[0]) == [("D", 1), ("A", 1), ("B", 18)]
    stats = d.scheduler.stats()
    assert stats["step_budget_tail_steps"] == 1


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("step_tail_fraction", 0.0, "--step-tail-fraction"),
        ("step_tail_fraction", 1.0, "--step-tail-fraction"),
        ("step_tail_min_tokens", 0, "--step-tail-min-tokens"),
    ],
)
def test_bad_tail_values_name_the_flag(field: str, value: float, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


def test_engine_config_passes_the_allowance_through() -> None:
    cfg = EngineConfig(step_tail_fraction=0.008, step_tail_min_tokens=32).step_budget_config()
    assert (cfg.tail_fraction, cfg.tail_min_tokens) == (0.008, 32)
