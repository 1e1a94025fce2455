"""The efficiency fit recovers known parameters from synthetic step timings."""

import numpy as np
import pytest

from kvserve.sim.calibrate import (
    StepRecord,
    fit_efficiency,
    load_step_records,
    save_step_records,
)
from kvserve.sim.cost_model import CostModel, Efficiency, StepShape
from kvserve.sim.hardware import get_hardware
from kvserve.sim.specs import get_model_spec


def _synthetic(cm: CostModel, truth: Efficiency, noise: float, seed: int) -> list[StepRecord]:
    rng = np.random.default_rng(seed)
    gen = CostModel(cm.model, cm.hardware, cm.tp, truth)
    records = []
    for _ in range(120):
        num_seqs = int(rng.integers(1, 32))
        decode = int(rng.integers(0, num_seqs + 1))
        prefill = int(rng.choice([0, 0, 16, 128, 512]))
        if prefill + decode == 0:
            decode = 1
        context = decode * int(rng.integers(1, 1500)) + prefill
        shape = StepShape(prefill, decode, context, num_seqs)
        t = gen.step_time(shape) * (1 + noise * rng.standard_normal())
        records.append(StepRecord(prefill, decode, context, num_seqs, float(t)))
    return records


def test_fit_recovers_known_parameters_exactly_without_noise() -> None:
    cm = CostModel(get_model_spec("smollm2-135m"), get_hardware("cpu"))
    truth = Efficiency(flops=0.35, bandwidth=0.55, overhead_s=4e-3)
    fit = fit_efficiency(_synthetic(cm, truth, 0.0, 0), cm)
    assert fit.num_compute_bound > 0 and fit.num_memory_bound > 0
    assert fit.flops_identified and fit.bandwidth_identified
    assert fit.efficiency.flops == pytest.approx(0.35, rel=1e-4)
    assert fit.efficiency.bandwidth == pytest.approx(0.55, rel=1e-4)
    assert fit.efficiency.overhead_s == pytest.approx(4e-3, rel=1e-4)
    assert fit.max_rel_error < 1e-4


def test_fit_with_noise_and_tensor_parallel_terms() -> None:
    cm = CostModel(get_model_spec("llama-3-8b"), get_hardware("h100"), tp=2)
    truth = Efficiency(flops=0.5, bandwidth=0.8, overhead_s=2e-3)
    fit = fit_efficiency(_synthetic(cm, truth, 0.02, 1), cm)
    assert fit.efficiency.flops == pytest.approx(0.5, rel=0.05)
    assert fit.efficiency.bandwidth == pytest.approx(0.8, rel=0.05)
    assert fit.efficiency.overhead_s == pytest.approx(2e-3, rel=0.15)
    assert 0.01 < fit.rms_rel_error < 0.04


def test_one_sided_data_keeps_the_prior() -> None:
    cm = CostModel(get_model_spec("llama-3-8b"), get_hardware("h100"))
    gen = CostModel(cm.model, cm.hardware, 1, Efficiency(0.4, 0.7, 1e-3))
    recs = [
        StepRecord(0, b, b * 500, b, gen.step_time(StepShape(0, b, b * 500, b)))
        for b in (1, 4, 16, 64)
    ]
    fit = fit_efficiency(recs, cm)
    assert fit.num_compute_bound == 0 and not fit.flops_identified
    assert fit.efficiency.flops == cm.efficiency.flops
    assert fit.efficiency.bandwidth == pytest.approx(0.7, rel=1e-4)


def test_records_jsonl_roundtrip_and_errors(tmp_path) -> None:
    recs = [StepRecord(4, 1, 9, 2, 0.01), StepRecord(0, 3, 30, 3, 0.02, num_attention_pairs=30)]
    p = tmp_path / "steps.jsonl"
    save_step_records(p, recs)
    assert load_step_records(p) == recs
    p.write_text('{"num_prefill_tokens": 1, "num_decode_tokens": 0}\n')
    with pytest.raises(ValueError, match="steps.jsonl:1"):
        load_step_records(p)
    with pytest.raises(ValueError, match="seconds"):
        StepRecord(1, 0, 1, 1, 0.0)
    with pytest.raises(ValueError, match="at least 3"):
        fit_efficiency(recs, CostModel(get_model_spec("smollm2-135m"), get_hardware("cpu")))
