"""The capacity-planning experiments by name, each a table plus a PNG.

``memory_experiments`` (paged vs contiguous, prefix cache, preemption),
``batching_experiments`` (static vs continuous, chunked prefill) and ``router_experiment``
(replicas behind the router). All of them drive the real Scheduler and KVCacheManager
(except the static-batching baseline, which has no scheduler to speak of) with the roofline
cost model as the clock.
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.sim.batching_experiments import chunked_prefill, static_vs_continuous
from kvserve.sim.memory_experiments import paged_vs_contiguous, preemption, prefix_cache
from kvserve.sim.router_experiment import router_replicas
from kvserve.sim.setup import ExperimentResult, SimSetup

EXPERIMENTS: dict[str, Callable[[SimSetup, str], ExperimentResult]] = {
    "paged-vs-contiguous": paged_vs_contiguous,
    "static-vs-continuous": static_vs_continuous,
    "chunked-prefill": chunked_prefill,
    "prefix-cache": prefix_cache,
    "preemption": preemption,
    "router": router_replicas,
}


def run_experiment(name: str, setup: SimSetup, out_dir: str) -> ExperimentResult:
    """Run one experiment by name (see EXPERIMENTS); raises ValueError for unknown names."""
    fn = EXPERIMENTS.get(name)
    if fn is None:
        raise ValueError(f"unknown experiment {name!r}; expected one of {', '.join(EXPERIMENTS)}")
    return fn(setup, out_dir)
