"""The runner times a step's host <-> device copies and reports them in its output."""

from __future__ import annotations

from kvserve.core.outputs import SchedulerOutput
from kvserve.runtime.model_runner import ModelRunner
from tests.runtime.runtime_testutil import ours_from_hf, sched_req, tiny_hf_model


def test_swap_times_are_measured_and_part_of_the_step() -> None:
    model, arch = ours_from_hf(tiny_hf_model("llama"))
    runner = ModelRunner(model, arch, num_blocks=16, block_size=4, num_host_blocks=8)
    out = runner.execute(
        SchedulerOutput(scheduled=[sched_req("a", list(range(7)), 0, 7, [0, 1], True)])
    )
    assert out.swap_in_time == out.swap_out_time == 0.0  # nothing moved
    out = runner.execute(SchedulerOutput(blocks_to_swap_out=[(0, 3), (1, 5)]))
    assert out.swap_out_time > 0 and out.swap_in_time == 0.0
    assert out.swap_out_time <= out.execute_time
    out = runner.execute(SchedulerOutput(blocks_to_swap_in=[(3, 9), (5, 10)]))
    assert out.swap_in_time > 0 and out.swap_out_time == 0.0
    assert out.swap_in_time <= out.execute_time
