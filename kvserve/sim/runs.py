"""One simulated run of a ``SimSetup`` (the experiments' common call) and their unit helper."""

from __future__ import annotations

from kvserve.sim.setup import SimSetup
from kvserve.sim.simulator import SimResult, simulate
from kvserve.sim.workloads import WorkloadRequest


def ms(v: float) -> float:
    """Seconds to milliseconds."""
    return v * 1e3


def run_sim(
    setup: SimSetup,
    workload: list[WorkloadRequest],
    *,
    num_blocks: int | None = None,
    block_size: int | None = None,
    prefix_caching: bool | None = None,
    num_host_blocks: int = 0,
    kv_sample_every: int = 4,
    **sched_overrides: object,
) -> SimResult:
    """Simulate ``workload`` on the setup's scheduler config (with ``sched_overrides``), cost
    model and KV pool; the keyword arguments override the setup's pool and prefix caching."""
    return simulate(
        workload,
        setup.sched_config(**sched_overrides),
        setup.cost_model(),
        num_blocks or setup.num_blocks(),
        block_size or setup.block_size,
        enable_prefix_caching=(
            setup.enable_prefix_caching if prefix_caching is None else prefix_caching
        ),
        num_host_blocks=num_host_blocks,
        vocab_size=setup.model.vocab_size,
        kv_sample_every=kv_sample_every,
    )
