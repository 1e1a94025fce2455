"""The KV-memory experiments: contiguous vs paged allocation, the prefix cache, and
preemption (recompute vs swap) under overload; each a table plus a PNG."""

from __future__ import annotations

import math

from kvserve.sim.hardware import GB
from kvserve.sim.plots import save_bars, save_figure
from kvserve.sim.runs import ms, run_sim
from kvserve.sim.setup import ExperimentResult, SimSetup
from kvserve.sim.workloads import generate_workload

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
    contiguous = run_sim(
        setup,
        wl,
        num_blocks=num_slots,
        block_size=max_len,
        prefix_caching=False,
        max_num_seqs=seats,
        admission_headroom=0.0,
        resume_watermark=0.0,
    )
    paged = run_sim(setup, wl, prefix_caching=False, max_num_seqs=seats)
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
                ms(s["ttft_p50_s"]),
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
            res = run_sim(setup, wl, prefix_caching=on)
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
                    ms(s["ttft_mean_s"]),
                    ms(s["ttft_p50_s"]),
                    ms(s["ttft_p99_s"]),
                    s["output_tokens_per_s"],
                ]
            )
            labels.append(f"{wname} {'on' if on else 'off'}")
            ttfts.append(ms(s["ttft_mean_s"]))
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
        res = run_sim(
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
                ms(s["ttft_p99_s"]),
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
