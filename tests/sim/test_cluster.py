"""The data-parallel cluster simulation: the real router policy over real schedulers."""

from __future__ import annotations

from kvserve.router.policy import PrefixAwarePolicy, RoundRobinPolicy
from kvserve.sim.cluster import simulate_cluster
from kvserve.sim.experiments import run_experiment
from kvserve.sim.hardware import get_hardware
from kvserve.sim.router_experiment import multi_tenant_trace
from kvserve.sim.setup import SimSetup
from kvserve.sim.specs import get_model_spec


def _setup(**kw: object) -> SimSetup:
    base = dict(
        model=get_model_spec("llama-3-8b"),
        hardware=get_hardware("h100"),
        max_model_len=2048,
        num_requests=160,
        max_num_seqs=16,
        max_num_batched_tokens=512,
    )
    base.update(kw)
    return SimSetup(**base)  # type: ignore[arg-type]


def test_cluster_finishes_every_request_and_prefix_routing_follows_conversations() -> None:
    setup = _setup()
    trace = multi_tenant_trace(
        96, 0, num_tenants=4, request_rate=20.0, system_prompt_len=256, max_turn_len=64,
        vocab_size=setup.model.vocab_size,
    )  # fmt: skip
    results = {}
    for policy in (RoundRobinPolicy(), PrefixAwarePolicy()):
        res = simulate_cluster(
            trace,
            policy,
            num_replicas=4,
            config=setup.sched_config(),
            step_time=setup.cost_model(),
            num_kv_blocks=setup.num_blocks(),
            vocab_size=setup.model.vocab_size,
        )
        assert sum(res.routed.values()) == len(trace) and not res.rejected
        assert all(t.finish_time is not None for t in res.latency.timings.values())
        results[policy.name] = res.summary(1.0, 0.1)
    assert results["round-robin"]["routed_max_over_mean"] == 1.0
    # later turns re-send their history: only prefix routing finds it on the same replica
    assert results["prefix"]["prefix_hit_rate"] > results["round-robin"]["prefix_hit_rate"]
    assert results["prefix"]["ttft_mean_s"] < results["round-robin"]["ttft_mean_s"]


def test_router_experiment_table_and_plot(tmp_path) -> None:  # noqa: ANN001
    res = run_experiment("router", _setup(), str(tmp_path))
    assert [r[0] for r in res.rows] == ["round-robin", "prefix"]
    hit = res.columns.index("hit rate")
    assert res.rows[1][hit] > res.rows[0][hit]
    with open(res.plot_path, "rb") as f:  # type: ignore[arg-type]
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
