"""(f) Data-parallel replicas behind the router: prefix-aware vs round-robin on one trace.

8 replicas (each the setup's model on ``tp`` GPUs, e.g. Llama-3-70B at TP=8 on H100s), one
multi-tenant trace: several system prompts, each with many multi-turn conversations (every
turn re-sends its history). Both runs use the real ``kvserve.router.policy`` objects.
"""

from __future__ import annotations

import math

from kvserve.router.policy import PrefixAwarePolicy, RoundRobinPolicy, RoutingPolicy
from kvserve.sim.cluster import ClusterResult, simulate_cluster
from kvserve.sim.plots import save_bars
from kvserve.sim.setup import ExperimentResult, SimSetup
from kvserve.sim.workloads import WorkloadRequest, generate_workload

NUM_REPLICAS = 8
NUM_TENANTS = 16
SLO_TTFT_S = 1.0
SLO_TPOT_S = 0.1


def multi_tenant_trace(
    num_requests: int,
    seed: int,
    *,
    num_tenants: int,
    request_rate: float,
    system_prompt_len: int,
    max_turn_len: int,
    vocab_size: int,
    num_turns: int = 4,
    think_time: float = 5.0,
) -> list[WorkloadRequest]:
    """``num_tenants`` multi-turn traces, each with its own system prompt, merged by arrival."""
    per = max(num_turns, math.ceil(num_requests / num_tenants))
    out: list[WorkloadRequest] = []
    for t in range(num_tenants):
        for w in generate_workload(
            "multi-turn",
            per,
            seed * 1000 + t,
            request_rate=request_rate / num_tenants,
            num_turns=num_turns,
            system_prompt_len=system_prompt_len,
            think_time=think_time,
            max_turn_len=max_turn_len,
            vocab_size=vocab_size,
        ):
            w.request_id = f"t{t}-{w.request_id}"
            w.prefix_group = f"t{t}-{w.prefix_group}"
            out.append(w)
    out.sort(key=lambda w: w.arrival_time)
    return out[:num_requests]


def _run(setup: SimSetup, trace: list[WorkloadRequest], policy: RoutingPolicy) -> ClusterResult:
    return simulate_cluster(
        trace,
        policy,
        num_replicas=NUM_REPLICAS,
        config=setup.sched_config(),
        step_time=setup.cost_model(),
        num_kv_blocks=setup.num_blocks(),
        block_size=setup.block_size,
        enable_prefix_caching=setup.enable_prefix_caching,
        vocab_size=setup.model.vocab_size,
    )


def router_replicas(setup: SimSetup, out_dir: str) -> ExperimentResult:
    """Hit rate, TTFT and goodput of prefix-aware vs round-robin routing over 8 replicas."""
    n = setup.num_requests or 2000
    trace = multi_tenant_trace(
        n,
        setup.seed,
        num_tenants=NUM_TENANTS,
        request_rate=setup.rate(960.0),
        system_prompt_len=min(2048, setup.model_len // 4),
        max_turn_len=max(8, setup.model_len // 16),
        vocab_size=setup.model.vocab_size,
    )
    rows = []
    labels: list[str] = []
    hit: list[float] = []
    ttft: list[float] = []
    good: list[float] = []
    for policy in (RoundRobinPolicy(), PrefixAwarePolicy()):
        res = _run(setup, trace, policy)
        s = res.summary(SLO_TTFT_S, SLO_TPOT_S)
        rows.append(
            [
                policy.name,
                s["prefix_hit_rate"],
                s["ttft_mean_s"] * 1e3,
                s["ttft_p90_s"] * 1e3,
                s["ttft_p99_s"] * 1e3,
                s["tpot_mean_s"] * 1e3,
                s["output_tokens_per_s"],
                s["goodput_requests_per_s"],
                s["slo_attainment"],
                s["routed_max_over_mean"],
            ]
        )
        labels.append(policy.name)
        hit.append(s["prefix_hit_rate"])
        ttft.append(s["ttft_mean_s"] * 1e3)
        good.append(s["goodput_requests_per_s"])
    path = save_bars(
        out_dir,
        "router",
        [
            ("prefix hit rate", "fraction", labels, hit),
            ("mean TTFT", "ms", labels, ttft),
            ("goodput", "req/s within SLO", labels, good),
        ],
        f"{NUM_REPLICAS} replicas of {setup.model.name}, each {setup.tp}x{setup.hardware.name}",
    )
    prompt_tokens = sum(w.prompt_len for w in trace)
    return ExperimentResult(
        "router",
        f"(f) data parallel: {NUM_REPLICAS} replicas behind prefix-aware vs round-robin routing",
        [
            "routing",
            "hit rate",
            "TTFT mean ms",
            "TTFT p90 ms",
            "TTFT p99 ms",
            "TPOT mean ms",
            "out tok/s",
            "goodput req/s",
            "SLO met",
            "busiest / mean routed",
        ],
        rows,
        [
            f"{len(trace)} requests ({prompt_tokens:,} prompt tokens): {NUM_TENANTS} tenants, "
            "each its own system prompt and 4-turn conversations re-sending their history, "
            f"conversations start at {setup.rate(960.0):g}/s in all, later turns follow after "
            "a 5 s mean think time",
            f"goodput: finished requests per second with TTFT <= {SLO_TTFT_S:g} s and TPOT <= "
            f"{SLO_TPOT_S * 1e3:g} ms; prefix routing: longest match unless 4 requests busier "
            "than the least-loaded replica, matches under half the prompt ignored",
            "each replica: the real Scheduler + KVCacheManager; routing: the real "
            "kvserve.router.policy objects",
        ],
        path,
    )
