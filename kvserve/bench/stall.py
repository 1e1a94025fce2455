"""Issue 51's stall targets, step-budget settings alternated in one engine.

Two scenarios on the embedded model (one engine; each round runs every setting in turn, so a
shared box's drift falls on all of them alike):

- ``long-prompt``: ``kvserve bench long-prompt``'s trial (a stream decodes, a LONG-token
  prompt arrives, a 4-token request one step later) with the 4-token request's TTFT as a
  ratio to its own idle run just before.
- ``arrivals``: a ShareGPT-like trace (outputs clipped to 128) replayed at its Poisson arrival
  times (``--request-rate``); pooled ITL median / p99, TTFT median / p90, output tokens/s.

A setting is ``off`` (no step-time budget), ``default`` (what the engine built by default),
``on`` (``--step-budget``) or ``auto`` (the measured default, ``MeasuredStepBudget``) with
optional ``StepBudgetConfig`` fields, e.g. ``on:decode_multiple=2,ttft_aging=0``. Each
budget has its own cost model (``default``: the engine's own) and is fed every step's
record, whichever setting ran the step.

    kvserve bench stall --scenario long-prompt --settings off default --rounds 2
    kvserve bench stall --scenario arrivals --settings off default --rounds 2
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics

from kvserve.bench.long_prompt import long_prompt_round, ttft_idle
from kvserve.bench.offline import run_offline, warm_up
from kvserve.core.sched.measured_budget import MeasuredStepBudget
from kvserve.core.sched.step_budget import StepBudgetConfig, StepTimeBudget
from kvserve.core.sched.step_cost import OnlineStepCostModel
from kvserve.engine.llm_engine import LLMEngine
from kvserve.percentile import percentile
from kvserve.sim.workloads import generate_workload, resolve_prompt_token_ids


def parse_setting(spec: str, default: StepTimeBudget | None) -> StepTimeBudget | None:
    """The budget a setting names (module docstring); ValueError on an unknown one."""
    if spec == "off":
        return None
    if spec == "default":
        return default
    name, _, fields = spec.partition(":")
    if name not in ("on", "auto"):
        raise ValueError(
            f"setting must be off, default, on[:field=value,...] or auto[:...], got {spec!r}"
        )
    kw: dict[str, object] = {}
    types = {f.name: f.type for f in dataclasses.fields(StepBudgetConfig)}
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition("=")
        if key not in types:
            raise ValueError(f"unknown StepBudgetConfig field {key!r} in {spec!r}")
        kw[key] = (
            value if key == "prefill_policy" else (int if "int" in types[key] else float)(value)
        )
    kind = MeasuredStepBudget if name == "auto" else StepTimeBudget
    return kind(StepBudgetConfig(**kw), OnlineStepCostModel())  # type: ignore[arg-type]


def _arrivals(engine: LLMEngine, args: argparse.Namespace, salt: int) -> dict[str, float]:
    trace = generate_workload(
        "sharegpt",
        args.num_prompts,
        seed=args.workload_seed,
        request_rate=args.request_rate,
        max_output_len=128,
        vocab_size=engine.arch.vocab_size,
    )
    # NOTE: fresh prompt ids per run (salt) and a reset prefix cache: no run hits another's.
    vocab = engine.arch.vocab_size
    trace = [
        dataclasses.replace(r, prompt_token_ids=resolve_prompt_token_ids(r, vocab, salt))
        for r in trace
    ]
    engine.kv_cache_manager.reset_prefix_cache()
    run = run_offline(engine, trace, replay_arrivals=True)
    itl = sorted(run.latency_samples["itl"])
    ttft = sorted(o.metrics.ttft for o in run.outputs if o.metrics and o.metrics.ttft)
    p50, p99 = percentile(itl, 50), percentile(itl, 99)
    return {
        "itl_p50_ms": p50 * 1e3,
        "itl_p99_ms": p99 * 1e3,
        "itl_p99_over_p50": p99 / p50,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "output_tok_s": run.figures["output_tokens_per_s"],
    }


def main(argv: list[str] | None = None) -> int:
    """Run the rounds and print one line per round and setting."""
    ap = argparse.ArgumentParser(prog="kvserve bench stall", description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=("long-prompt", "arrivals"), default="long-prompt")
    ap.add_argument("--settings", nargs="+", default=["off", "default"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--long-len", type=int, default=3000)
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--request-rate", type=float, default=1.5, help="inf: all at once")
    ap.add_argument("--workload-seed", type=int, default=11)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    args = ap.parse_args(argv)
    engine = LLMEngine(num_threads=args.num_threads, max_num_seqs=args.max_num_seqs)
    own = engine.scheduler.step_budget
    settings = {s: parse_setting(s, own) for s in args.settings}
    budgets = [b for b in {id(b): b for b in settings.values() if b is not None}.values()]

    def observe(record: dict[str, float]) -> None:
        # NOTE: every budget learns from every step, whichever setting runs it, as the
        # engine's own budget would over a server's life (an "off" round included).
        for b in budgets:
            b.observe(record)

    engine.scheduler.observe_step = observe  # type: ignore[method-assign]
    rng = random.Random(51)
    warm_up(engine)
    ttft_idle(engine, rng)
    # NOTE: a warm-up round: the fit sees decodes beside prefill chunks.
    long_prompt_round(engine, rng, 1000)
    for r in range(args.rounds):
        for i, (name, budget) in enumerate(settings.items()):
            engine.scheduler.step_budget = budget
            capped = budget.num_capped_steps if budget is not None else 0
            unheld = budget.num_unheld_plans if isinstance(budget, MeasuredStepBudget) else 0
            if args.scenario == "arrivals":
                res = _arrivals(engine, args, salt=100 * r + i)
            else:
                idle = statistics.median(ttft_idle(engine, rng) for _ in range(3))
                res = {"idle_ttft_s": idle, **long_prompt_round(engine, rng, args.long_len)}
                res["short_over_idle"] = res["short_ttft_s"] / idle
            if budget is not None:
                res["capped_steps"] = budget.num_capped_steps - capped
            if isinstance(budget, MeasuredStepBudget):
                res.update(
                    fit_error=budget.fit_error, unheld_steps=budget.num_unheld_plans - unheld
                )
            figures = " ".join(f"{k}={v:.3f}" for k, v in res.items())
            print(f"round={r} setting={name} {figures}", flush=True)
    for name, b in settings.items():
        if b is not None and isinstance(b.cost, OnlineStepCostModel) and b.cost.ready:
            print(name, " ".join(f"{k}={v:.4g}" for k, v in b.cost.describe().items()))
    return 0
