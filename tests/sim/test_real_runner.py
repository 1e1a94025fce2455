"""The simulator and the real engine make the same scheduling decisions on the same trace.

The core is shared, so with step times fed back identically the sequence of scheduled
(request id, tokens) per step must match whether the tokens come from the simulator's fake
runner or from the real ModelRunner computing a (tiny, random-weight) Llama on a paged KV
cache. Requests run with ignore_eos and fixed output lengths, and the trace has no scripted
multi-turn replies, so token values cannot steer the scheduler.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.config import SchedulerConfig
from kvserve.runtime.model_runner import ModelRunner
from kvserve.sim.cost_model import CostModel
from kvserve.sim.hardware import get_hardware
from kvserve.sim.simulator import Simulator, build_scheduler, simulate
from kvserve.sim.specs import get_model_spec
from kvserve.sim.workloads import WorkloadRequest, generate_workload
from tests.runtime.runtime_testutil import ours_from_hf, tiny_hf_model

COST = CostModel(get_model_spec("llama-3-8b"), get_hardware("h100"))
NUM_BLOCKS = 24
NUM_HOST_BLOCKS = 24


def _trace(vocab_size: int) -> list[WorkloadRequest]:
    a = generate_workload(
        "shared-prefix",
        6,
        0,
        request_rate=40.0,
        num_groups=2,
        prefix_len=40,
        vocab_size=vocab_size,
    )
    b = generate_workload(
        "random",
        6,
        2,
        vocab_size=vocab_size,
        request_rate=30.0,
        min_prompt_len=30,
        max_prompt_len=90,
        min_output_len=8,
        max_output_len=24,
    )
    reqs = [dataclasses.replace(w, request_id=f"sp-{w.request_id}") for w in a]
    reqs += [dataclasses.replace(w, request_id=f"r-{w.request_id}") for w in b]
    return sorted(reqs, key=lambda w: w.arrival_time)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_real_runner_and_simulator_schedule_identically(mode: str) -> None:
    model, arch = ours_from_hf(tiny_hf_model("llama"))
    cfg = SchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=64, max_model_len=256, preemption_mode=mode
    )
    host = NUM_HOST_BLOCKS if mode == "swap" else 0
    wl = _trace(arch.vocab_size)

    simulated = simulate(
        wl,
        cfg,
        COST,
        NUM_BLOCKS,
        num_host_blocks=host,
        vocab_size=arch.vocab_size,
        record_trace=True,
    )
    scheduler, clock = build_scheduler(cfg, NUM_BLOCKS, num_host_blocks=host)
    runner = ModelRunner(model, arch, num_blocks=NUM_BLOCKS, block_size=16, num_host_blocks=host)
    real = Simulator(
        scheduler,
        COST,
        clock,
        runner=runner.execute,
        vocab_size=arch.vocab_size,
        record_trace=True,
    ).run(wl)

    assert simulated.stats["preemptions"] > 0  # the small pool forces preemption
    assert simulated.stats["prefix_cache_hits"] > 0
    assert real.trace == simulated.trace
    assert real.stats["preemptions"] == simulated.stats["preemptions"]
    scheduler.kv.check_integrity()
    assert scheduler.kv.usage == 0
