"""The five capacity-planning experiments, each a table plus a PNG.

All of them drive the real Scheduler and KVCacheManager (except the static-batching baseline,
which has no scheduler to speak of) with the roofline cost model as the clock.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from kvserve.sim.hardware import GB
from kvserve.sim.plots import save_bars, save_figure
from kvserve.sim.router_experiment import router_replicas
from kvserve.sim.setup import ExperimentResult, SimSetup
from kvserve.sim.simulator import SimResult, simulate
from kvserve.sim.static_batch import simulate_static
from kvserve.sim.workloads import WorkloadRequest, generate_workload


def _ms(v: float) -> float:
    return v * 1e3


def _run(
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


# --- (a) contiguous vs paged ---------------------------------------------------------------


def paged_vs_contiguous(setup: SimSetup, out_dir: str) -> ExperimentResult:
    """Memory waste and max batch: reserve max_model_len per request vs blocks on demand.

    Contiguous reservation is run on the same real KVCacheManager with one block of
    ``max_model_len`` tokens per request (a block table of one slot = a contiguous region);
    paged uses ``block_size`` blocks allocated as tokens arrive.
    """
    n = setup.num_requests or 2000
    wl = setup.sharegpt(n, setup.rate())
    max_len = setup.model_len
    pool_tokens = setup.num_blocks() * setup.block_size
    num_slots = pool_tokens // max_len
    if num_slots < 1:
        raise ValueError(f"the KV pool ({pool_tokens} tokens) holds no {max_len}-token slot")
    # NOTE: seats are not the limit here (memory is); a full reservation never grows, so the
    # contiguous run needs no admission headroom.
    seats = max(setup.max_num_seqs, 2048)
    contiguous = _run(
        setup,
        wl,
        num_blocks=num_slots,
        block_size=max_len,
        prefix_caching=False,
        max_num_seqs=seats,
        admission_headroom=0.0,
        resume_watermark=0.0,
    )
    paged = _run(setup, wl, prefix_caching=False, max_num_seqs=seats)
    mean_len = sum(w.prompt_len + w.output_len for w in wl) / len(wl)
    rows = []
    # Memory-bound batch: how many requests of the mean length the pool holds at once.
    paged_fit = int(pool_tokens // (setup.block_size * math.ceil(mean_len / setup.block_size)))
    for name, res, unit, fit in (
        (f"contiguous (reserve {max_len})", contiguous, f"{num_slots:,} slots", num_slots),
        (f"paged (block {setup.block_size})", paged, f"{setup.num_blocks():,} blocks", paged_fit),
    ):
        s = res.summary()
        rows.append(
            [
                name,
                unit,
                fit,
                int(s["max_concurrent_requests"]),
                s["mean_fragmentation"],
                s["output_tokens_per_s"],
                _ms(s["ttft_p50_s"]),
                s["e2e_p50_s"],
                s["duration_s"],
            ]
        )
    path = save_figure(
        out_dir,
        "paged_vs_contiguous",
        [
            (
                "running requests",
                "time (s)",
                "requests",
                [
                    ("contiguous", contiguous.step_end_times, contiguous.step_num_running),
                    ("paged", paged.step_end_times, paged.step_num_running),
                ],
                False,
            ),
            (
                "KV pool in use",
                "time (s)",
                "kv_usage",
                [
                    ("contiguous", contiguous.step_end_times, contiguous.step_kv_usage),
                    ("paged", paged.step_end_times, paged.step_kv_usage),
                ],
                False,
            ),
        ],
        f"{setup.model.name} on {setup.tp}x{setup.hardware.name}: contiguous vs paged KV",
    )
    return ExperimentResult(
        "paged-vs-contiguous",
        f"(a) contiguous vs paged KV allocation, {n} ShareGPT-like requests",
        [
            "allocation",
            "pool",
            "batch that fits",
            "max batch seen",
            "KV waste (mean)",
            "out tok/s",
            "TTFT p50 ms",
            "e2e p50 s",
            "makespan s",
        ],
        rows,
        [
            f"KV pool {pool_tokens:,} tokens; mean request {mean_len:.0f} tokens "
            f"(prompt + output), max_model_len {max_len}",
            "KV waste = 1 - tokens stored / tokens reserved by live requests "
            "(KVCacheManager fragmentation), averaged over steps",
            "batch that fits = slots (contiguous) or pool / mean request rounded up to blocks "
            "(paged, at full length); max batch seen = peak RUNNING in the run (seat cap "
            f"{seats}; the paged peak is bounded by the trace and the token budget, not memory)",
        ],
        path,
    )


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
            ("continuous", _run(setup, wl).summary()),
        )
        for mode, s in runs:
            rows.append(
                [
                    mode,
                    rate,
                    s["output_tokens_per_s"],
                    s["requests_per_s"],
                    _ms(s["ttft_p50_s"]),
                    s["e2e_p50_s"],
                    s["e2e_p99_s"],
                    _ms(s["tpot_mean_s"]),
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
        res = _run(setup, wl, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
        s = res.summary()
        long_ttft = [
            t.ttft for rid, t in res.latency.timings.items() if rid.startswith("long-") and t.ttft
        ]
        mean_long = sum(long_ttft) / len(long_ttft) if long_ttft else float("nan")
        rows.append(
            [
                label,
                chunked,
                _ms(s["itl_p50_s"]),
                _ms(s["itl_p99_s"]),
                _ms(max(res.latency.itls, default=float("nan"))),
                _ms(mean_long),
                s["output_tokens_per_s"],
            ]
        )
        if chunked:
            itl_max = _ms(max(res.latency.itls, default=float("nan")))
            pts.append((budget, _ms(s["itl_p99_s"]), _ms(s["itl_p50_s"]), _ms(mean_long), itl_max))
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


def prefix_cache(setup: SimSetup, out_dir: str) -> ExperimentResult:
    """Hit rate and TTFT with the radix prefix cache on and off (multi-turn, shared prefix)."""
    n = setup.num_requests or 800
    traces = {
        "multi-turn": generate_workload(
            "multi-turn",
            n,
            setup.seed,
            request_rate=setup.rate(4.0),
            num_turns=4,
            system_prompt_len=min(1024, setup.model_len // 8),
            think_time=5.0,
            max_turn_len=max(8, setup.model_len // 16),
            vocab_size=setup.model.vocab_size,
        ),
        "shared-prefix": generate_workload(
            "shared-prefix",
            max(8, n // 2),
            setup.seed,
            request_rate=setup.rate(8.0),
            num_groups=min(8, max(1, n // 8)),
            prefix_len=min(2048, setup.model_len // 4),
            suffix_len=128,
            output_len=128,
            vocab_size=setup.model.vocab_size,
        ),
    }
    rows = []
    labels: list[str] = []
    ttfts: list[float] = []
    for wname, wl in traces.items():
        prompt_tokens = sum(w.prompt_len for w in wl)
        for on in (False, True):
            res = _run(setup, wl, prefix_caching=on)
            s = res.summary()
            computed = sum(
                t.num_prompt_tokens - t.num_cached_tokens for t in res.latency.timings.values()
            )
            rows.append(
                [
                    wname,
                    "on" if on else "off",
                    s["prefix_hit_rate"],
                    computed / prompt_tokens,
                    _ms(s["ttft_mean_s"]),
                    _ms(s["ttft_p50_s"]),
                    _ms(s["ttft_p99_s"]),
                    s["output_tokens_per_s"],
                ]
            )
            labels.append(f"{wname} {'on' if on else 'off'}")
            ttfts.append(_ms(s["ttft_mean_s"]))
    hit = [r[2] for r in rows]
    path = save_bars(
        out_dir,
        "prefix_cache",
        [("mean TTFT", "ms", labels, ttfts), ("prefix hit rate", "fraction", labels, hit)],
        f"{setup.model.name} on {setup.tp}x{setup.hardware.name}: prefix caching",
    )
    return ExperimentResult(
        "prefix-cache",
        "(d) prefix caching: multi-turn chat and shared system prompts",
        [
            "workload",
            "prefix cache",
            "hit rate",
            "prefill computed",
            "TTFT mean ms",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "out tok/s",
        ],
        rows,
        [
            f"multi-turn: {n} turns (4 per conversation), every turn re-sends the history; "
            "one system prompt shared by all conversations",
            "prefill computed = prompt tokens actually computed / prompt tokens sent",
        ],
        path,
    )


# --- (e) preemption -----------------------------------------------------------------------


def preemption(setup: SimSetup, out_dir: str, overload: float = 2.5) -> ExperimentResult:
    """Recompute vs swap under overload; swap pays host<->device copies over PCIe."""
    n = setup.num_requests or 300
    max_out = min(2048, setup.model_len // 2)
    wl = generate_workload(
        "random",
        n,
        setup.seed,
        request_rate=setup.rate(),
        min_prompt_len=256,
        max_prompt_len=min(1024, setup.model_len // 4),
        min_output_len=max_out // 4,
        max_output_len=max_out,
    )
    seats = max(setup.max_num_seqs, n)
    bs = setup.block_size
    demand = sum(-(-(w.prompt_len + w.output_len) // bs) for w in wl[:seats])
    biggest = max(-(-(w.prompt_len + w.output_len) // bs) for w in wl)
    num_blocks = min(setup.num_blocks(), max(biggest * 2, int(demand / overload)))
    try:
        num_host = setup.memory_plan().num_host_blocks
    except ValueError:  # the pool was given explicitly and the model does not fit the plan
        num_host = num_blocks
    block_bytes = bs * setup.model.kv_bytes_per_token
    rows = []
    bars: list[tuple[str, float, float]] = []
    for mode, caching in (("recompute", True), ("recompute", False), ("swap", True)):
        res = _run(
            setup,
            wl,
            num_blocks=num_blocks,
            prefix_caching=caching,
            num_host_blocks=num_host if mode == "swap" else 0,
            preemption_mode=mode,
            max_num_seqs=seats,
        )
        s = res.summary()
        moved = (s["swap_out_blocks"] + s["swap_in_blocks"]) * block_bytes
        label = f"{mode}{'' if caching else ', no prefix cache'}"
        rows.append(
            [
                label,
                int(s["preemptions"]),
                int(res.stats.get("prefix_cache_hits", 0)),
                int(s["recomputed_tokens_wasted"]),
                moved / GB,
                s["output_tokens_per_s"],
                _ms(s["ttft_p99_s"]),
                s["e2e_p50_s"],
                s["e2e_p99_s"],
                s["duration_s"],
            ]
        )
        bars.append((label, s["output_tokens_per_s"], s["e2e_p99_s"]))
    path = save_bars(
        out_dir,
        "preemption",
        [
            ("throughput", "output tokens/s", [b[0] for b in bars], [b[1] for b in bars]),
            ("e2e p99", "s", [b[0] for b in bars], [b[2] for b in bars]),
        ],
        f"{setup.model.name} on {setup.tp}x{setup.hardware.name}: preemption under overload",
    )
    return ExperimentResult(
        "preemption",
        f"(e) preemption under overload: recompute vs swap, {n} requests at once",
        [
            "mode",
            "preemptions",
            "prefix hit tokens",
            "recomputed tokens",
            "swapped GB",
            "out tok/s",
            "TTFT p99 ms",
            "e2e p50 s",
            "e2e p99 s",
            "makespan s",
        ],
        rows,
        [
            f"KV pool cut to {num_blocks:,} blocks ({num_blocks * bs:,} tokens), 1/{overload:g} of "
            f"the {demand * bs:,} tokens the admitted requests grow to; host tier "
            f"{num_host:,} blocks; swap time = blocks x per-GPU block bytes / "
            f"{setup.hardware.host_link_bandwidth / GB:.0f} GB/s host link",
        ],
        path,
    )


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
