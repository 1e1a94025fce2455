"""The batching experiments: static batches vs continuous batching, and chunked prefill;
each a table plus a PNG."""

from __future__ import annotations

import dataclasses
import math

from kvserve.sim.plots import save_figure
from kvserve.sim.runs import ms, run_sim
from kvserve.sim.setup import ExperimentResult, SimSetup
from kvserve.sim.static_batch import simulate_static
from kvserve.sim.workloads import WorkloadRequest, generate_workload

# --- (b) static vs continuous -------------------------------------------------------------


def static_vs_continuous(setup: SimSetup, out_dir: str) -> ExperimentResult:
    """Throughput and latency of static batches vs iteration-level scheduling."""
    n = setup.num_requests or 1000
    rates = [setup.request_rate] if setup.request_rate else [4.0, 16.0, math.inf]
    cm = setup.cost_model()
    pool_tokens = setup.num_blocks() * setup.block_size
    rows = []
    series: dict[str, list[tuple[float, float, float]]] = {"static": [], "continuous": []}
    for rate in rates:
        wl = setup.sharegpt(n, rate)
        runs = (
            ("static", simulate_static(wl, cm, setup.max_num_seqs, pool_tokens).summary()),
            ("continuous", run_sim(setup, wl).summary()),
        )
        for mode, s in runs:
            rows.append(
                [
                    mode,
                    rate,
                    s["output_tokens_per_s"],
                    s["requests_per_s"],
                    ms(s["ttft_p50_s"]),
                    s["e2e_p50_s"],
                    s["e2e_p99_s"],
                    ms(s["tpot_mean_s"]),
                ]
            )
            series[mode].append((rate, s["output_tokens_per_s"], s["e2e_p50_s"]))
    x_of = {
        r: (r if math.isfinite(r) else 2 * max([1.0] + [q for q in rates if q != r])) for r in rates
    }
    path = save_figure(
        out_dir,
        "static_vs_continuous",
        [
            (
                "throughput",
                "request rate (req/s; last = all at t=0)",
                "output tokens/s",
                [(m, [x_of[r] for r, _, _ in v], [t for _, t, _ in v]) for m, v in series.items()],
                True,
            ),
            (
                "median end-to-end latency",
                "request rate (req/s; last = all at t=0)",
                "e2e p50 (s)",
                [(m, [x_of[r] for r, _, _ in v], [e for _, _, e in v]) for m, v in series.items()],
                True,
            ),
        ],
        f"{setup.model.name} on {setup.tp}x{setup.hardware.name}: static vs continuous",
    )
    return ExperimentResult(
        "static-vs-continuous",
        f"(b) static vs continuous batching, {n} ShareGPT-like requests",
        [
            "batching",
            "rate req/s",
            "out tok/s",
            "req/s",
            "TTFT p50 ms",
            "e2e p50 s",
            "e2e p99 s",
            "TPOT mean ms",
        ],
        rows,
        [
            f"batch size {setup.max_num_seqs} for both; static pads prompts to the longest and "
            "decodes until the longest output is done; its requests complete at batch end",
        ],
        path,
    )


# --- (c) chunked prefill ------------------------------------------------------------------


def _long_len(setup: SimSetup) -> int:
    return min(7000, int(setup.model_len * 0.85))


def _chunked_workload(setup: SimSetup) -> list[WorkloadRequest]:
    n_bg = setup.num_requests or 300
    long_len = _long_len(setup)
    bg = generate_workload(
        "random",
        n_bg,
        setup.seed,
        request_rate=setup.rate(20.0),
        min_prompt_len=64,
        max_prompt_len=256,
        min_output_len=256,
        max_output_len=512,
    )
    span = bg[-1].arrival_time or 1.0
    n_long = max(4, n_bg // 15)
    long = generate_workload(
        "random",
        n_long,
        setup.seed + 1,
        request_rate=n_long / span,
        min_prompt_len=long_len - 1000,
        max_prompt_len=long_len,
        min_output_len=16,
        max_output_len=32,
    )
    wl = [dataclasses.replace(w, request_id=f"bg-{w.request_id}") for w in bg]
    wl += [dataclasses.replace(w, request_id=f"long-{w.request_id}") for w in long]
    return sorted(wl, key=lambda w: w.arrival_time)


def chunked_prefill(setup: SimSetup, out_dir: str) -> ExperimentResult:
    """p99 inter-token latency vs the step token budget with long prompts arriving."""
    wl = _chunked_workload(setup)
    n_long = sum(w.request_id.startswith("long-") for w in wl)
    budgets = [b for b in (256, 512, 1024, 2048, 4096, 8192) if b <= setup.model_len]
    rows = []
    pts: list[tuple[int, float, float, float, float]] = []
    runs: list[tuple[str, int, bool]] = [(str(b), b, True) for b in budgets]
    runs.append(("off", setup.model_len, False))
    for label, budget, chunked in runs:
        res = run_sim(setup, wl, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
        s = res.summary()
        long_ttft = [
            t.ttft for rid, t in res.latency.timings.items() if rid.startswith("long-") and t.ttft
        ]
        mean_long = sum(long_ttft) / len(long_ttft) if long_ttft else float("nan")
        rows.append(
            [
                label,
                chunked,
                ms(s["itl_p50_s"]),
                ms(s["itl_p99_s"]),
                ms(max(res.latency.itls, default=float("nan"))),
                ms(mean_long),
                s["output_tokens_per_s"],
            ]
        )
        if chunked:
            itl_max = ms(max(res.latency.itls, default=float("nan")))
            pts.append((budget, ms(s["itl_p99_s"]), ms(s["itl_p50_s"]), ms(mean_long), itl_max))
    path = save_figure(
        out_dir,
        "chunked_prefill",
        [
            (
                "inter-token latency",
                "max_num_batched_tokens (chunk budget)",
                "ms",
                [
                    ("ITL max", [p[0] for p in pts], [p[4] for p in pts]),
                    ("ITL p99", [p[0] for p in pts], [p[1] for p in pts]),
                    ("ITL p50", [p[0] for p in pts], [p[2] for p in pts]),
                ],
                True,
            ),
            (
                "TTFT of the long prompts",
                "max_num_batched_tokens (chunk budget)",
                "ms",
                [("TTFT mean", [p[0] for p in pts], [p[3] for p in pts])],
                True,
            ),
        ],
        f"{setup.model.name} on {setup.tp}x{setup.hardware.name}: chunked prefill",
    )
    return ExperimentResult(
        "chunked-prefill",
        f"(c) chunked prefill: {len(wl) - n_long} chat requests + {n_long} long prompts",
        [
            "budget",
            "chunked",
            "ITL p50 ms",
            "ITL p99 ms",
            "ITL max ms",
            "long TTFT ms",
            "out tok/s",
        ],
        rows,
        [
            "budget = max_num_batched_tokens (the largest prefill chunk a step can carry); "
            f"'off' = chunked prefill disabled with a {setup.model_len}-token budget",
            "ITL max = the stall a decode sees when a step carries the largest prefill chunk; "
            "p99 also depends on how many steps carry one (fewer, longer stalls at big budgets)",
            "chat: prompts 64-256, outputs 256-512 tokens; long prompts "
            f"{_long_len(setup) - 1000}-{_long_len(setup)} tokens",
        ],
        path,
    )


# --- (d) prefix caching -------------------------------------------------------------------
