"""The online step cost model: its fit on recorded steps, drift, and its guards."""

from __future__ import annotations

import random

import pytest

from kvserve.core.sched.step_cost import OnlineStepCostModel, StepLoad, chunk_pairs

# A CPU-like truth: 20 ms a step, 4 ms a decode row, 1.1 ms a prefill token, 2 us a context
# token, 5 ns a prefill attention pair (the decode pairs equal their context tokens).
TRUE = (0.020, 0.004, 0.0011, 2e-6, 5e-9)


def true_seconds(load: StepLoad, scale: float = 1.0) -> float:
    c0, cd, cp, cc, ca = TRUE
    return scale * (
        c0
        + cd * load.num_decode_tokens
        + cp * load.num_prefill_tokens
        + cc * load.num_context_tokens
        + ca * load.num_attention_pairs
    )


def recorded_steps(n: int, seed: int) -> list[StepLoad]:
    """Step shapes like the engine's: decode batches, lone prefills, mixed steps."""
    rng = random.Random(seed)
    loads = []
    for _ in range(n):
        contexts = [rng.randint(20, 900) for _ in range(rng.randint(0, 24))]
        load = StepLoad.decodes(contexts)
        if not contexts or rng.random() < 0.3:
            load = load.plus_chunk(rng.choice([0, 0, 64, 300]), rng.randint(8, 512))
        loads.append(load)
    return loads


def test_fit_recovers_the_step_times_of_recorded_steps() -> None:
    rng = random.Random(1)
    model = OnlineStepCostModel(window=256, refit_every=8)
    for load in recorded_steps(400, seed=2):
        model.observe(load, true_seconds(load) * rng.uniform(0.95, 1.05))  # +-5 % noise
    assert model.ready
    for load in recorded_steps(200, seed=3):
        assert model.predict(load) == pytest.approx(true_seconds(load), rel=0.08)
    d = model.describe()
    assert d["step_cost_prefill_token_ms"] == pytest.approx(1.1, rel=0.1)


def test_fit_separates_a_prefill_chunk_s_own_cost_from_its_tokens() -> None:
    """A fixed cost per chunk (its attention call, the mixed step's extra work): small chunks
    are predicted with it, not with a per-token cost inflated to cover it."""
    rng = random.Random(8)
    model = OnlineStepCostModel(window=256, refit_every=8)
    for load in recorded_steps(400, seed=9):
        t = true_seconds(load) + 0.008 * load.num_prefill_chunks
        model.observe(load, t * rng.uniform(0.97, 1.03))
    d = model.describe()
    assert d["step_cost_prefill_chunk_ms"] == pytest.approx(8.0, rel=0.15)
    assert d["step_cost_prefill_token_ms"] == pytest.approx(1.1, rel=0.1)
    small = StepLoad.decodes([200] * 4).plus_chunk(0, 16)
    assert model.predict(small) == pytest.approx(true_seconds(small) + 0.008, rel=0.05)
    two = StepLoad.decodes([200] * 4).plus_chunk(0, 16).plus_chunk(0, 16)
    assert two.num_prefill_chunks == 2 and StepLoad().plus_chunk(5, 0).num_prefill_chunks == 0


def test_fit_follows_a_drifting_machine() -> None:
    model = OnlineStepCostModel(window=64, refit_every=4)
    for load in recorded_steps(200, seed=4):
        model.observe(load, true_seconds(load))
    probe = StepLoad.decodes([300] * 8).plus_chunk(0, 128)
    assert model.predict(probe) == pytest.approx(true_seconds(probe), rel=0.02)
    for load in recorded_steps(300, seed=5):  # 1.6x slower; both windows turn over
        model.observe(load, true_seconds(load, scale=1.6))
    assert model.predict(probe) == pytest.approx(true_seconds(probe, scale=1.6), rel=0.02)


def test_coefficients_stay_non_negative_and_predictions_monotone() -> None:
    # Times that do not depend on context at all, with noise that would pull its term negative.
    rng = random.Random(6)
    model = OnlineStepCostModel(window=128, refit_every=4)
    for load in recorded_steps(300, seed=7):
        t = 0.02 + 0.004 * load.num_decode_tokens + 0.001 * load.num_prefill_tokens
        model.observe(load, t * rng.uniform(0.9, 1.1))
    assert model.coefficients is not None
    assert all(c >= 0.0 for c in model.coefficients)
    base = StepLoad.decodes([100] * 6)
    times = [model.predict(base.plus_chunk(40, n)) for n in range(0, 600, 7)]
    assert times == sorted(times)


def test_not_ready_until_both_kinds_of_step_were_seen() -> None:
    model = OnlineStepCostModel(min_records=3)
    for _ in range(20):
        model.observe(StepLoad.decodes([50, 60]), 0.05)
    assert not model.ready
    with pytest.raises(RuntimeError, match="no fit"):
        model.predict(StepLoad.decodes([1]))
    for n in (32, 64, 128):
        model.observe(StepLoad().plus_chunk(0, n), 0.02 + 0.001 * n)
    assert model.ready


def test_ignores_empty_steps_and_bad_times() -> None:
    model = OnlineStepCostModel()
    model.observe(StepLoad(), 0.5)
    model.observe(StepLoad.decodes([4]), 0.0)
    model.observe(StepLoad.decodes([4]), float("inf"))
    assert model.num_observed == 0
    with pytest.raises(ValueError, match="min_records"):
        OnlineStepCostModel(window=4, min_records=5)


def test_load_from_an_engine_step_record() -> None:
    rec = {
        "num_prefill_tokens": 30,
        "num_decode_tokens": 2,
        "num_context_tokens": 30 + 11 + 21,
        "num_attention_pairs": chunk_pairs(0, 30) + 11 + 21,
        "num_seqs": 3,
        "seconds": 0.1,
    }
    assert StepLoad.from_record(rec) == StepLoad.decodes([11, 21]).plus_chunk(0, 30)
    assert chunk_pairs(10, 3) == 3 * 10 + 6
