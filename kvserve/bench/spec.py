"""``kvserve bench spec``: tokens/s with and without speculative decoding (issue 52).

Three workloads, each run on a plain engine and on one with ``--speculative-config`` (the
same engine flags otherwise), alternating plain / speculative ``--repeats`` times so a
drifting machine load falls on both; the median run of each is reported:

- ``copy``: one stream, chat prompts that ask to repeat or edit a given list, text or code
  (the output copies its prompt: what n-gram drafts are for);
- ``fresh``: one stream, chat prompts whose answers copy nothing;
- ``sharegpt``: the ShareGPT-like synthetic trace (``sim/workloads.py``), all requests in
  flight at once (``--num-inflight``, 32).

Greedy sampling, so both engines generate the same tokens; the outputs are compared (greedy
speculation must not change them on a batch-invariant path). ``copy`` answers end at EOS
(``--copy-max-tokens`` at most): what follows EOS is not the copy the workload measures but
the model inventing a next turn, fresh text. ``fresh`` and ``sharegpt`` ignore EOS and run
``--output-len`` / the trace's lengths.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from kvserve.bench.report import make_record, write_json
from kvserve.engine.config import EngineConfig
from kvserve.sampling_params import SamplingParams
from kvserve.sim.workloads import generate_workload, resolve_prompt_token_ids

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'

LIST = "apples, pears, plums, cherries, figs, dates, lemons, limes, grapes, melons"
CODE = (
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n"
    "    return total / len(xs)\n"
)
TEXT = (
    "The committee met on Tuesday to review the budget. It agreed to fund the new library, "
    "to repair the bridge on Mill Road and to hire two more nurses for the clinic."
)
COPY_PROMPTS = [
    f"Repeat this list exactly, then repeat it once more: {LIST}",
    f"Rename the function to average and keep everything else the same:\n\n{CODE}",
    f"Copy this paragraph word for word:\n\n{TEXT}",
]
FRESH_PROMPTS = [
    "Write a short poem about the sea at night.",
    "Explain in a few sentences why the sky is blue.",
    "Describe a busy market on a summer morning.",
]


def register(sub: argparse._SubParsersAction, engine_parser: Any) -> None:
    """Add ``bench spec``."""
    p = engine_parser(sub, "spec", "tokens/s with and without speculative decoding")
    g = p.add_argument_group("speculation")
    g.add_argument("--spec-config", default=DEFAULT_SPEC, help="the speculative engine's JSON")
    g.add_argument(
        "--draft-model",
        default=None,
        metavar="PATH",
        help="speculate with this draft model (same tokenizer) instead of n-gram lookup; "
        "--spec-config's num_speculative_tokens and cost keys still apply",
    )
    g.add_argument("--workloads", nargs="+", choices=["copy", "fresh", "sharegpt"], default=None)
    g.add_argument("--output-len", type=int, default=64, help="tokens per fresh request")
    g.add_argument(
        "--copy-max-tokens", type=int, default=256, help="a copy answer's cap (it ends at EOS)"
    )
    g.add_argument("--num-inflight", type=int, default=32, help="sharegpt: requests at once")
    g.add_argument("--sharegpt-output-len", type=int, default=24)
    g.add_argument("--repeats", type=int, default=2, help="runs per engine and workload")
    g.add_argument("--output-json", default=None, help="write the result record here")
    p.set_defaults(func=cmd_spec)


def _run(engine: Any, prompts: list[list[int]], params: Any, at_once: bool) -> tuple:
    """Generate ``prompts`` (one at a time, or all at once) with ``params`` (one, or one
    per prompt); (tokens, seconds, outputs in prompt order)."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    outputs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    batches = [prompts] if at_once else [[p] for p in prompts]
    for batch in batches:
        for i, prompt in enumerate(batch):
            n = len(outputs) + i
            engine.add_request(prompt, per_prompt[n], request_id=f"r{n}")
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
    seconds = time.perf_counter() - t0
    ordered = [outputs[k] for k in sorted(outputs, key=lambda k: int(k[1:]))]
    return sum(len(o) for o in ordered), seconds, ordered


def _workloads(engine: Any, args: argparse.Namespace) -> dict[str, tuple]:
    """name -> (prompt ids, params, all at once)."""
    tok = engine.tokenizer
    chat = [tok.apply_chat_template([{"role": "user", "content": m}]) for m in COPY_PROMPTS]
    fresh = [tok.apply_chat_template([{"role": "user", "content": m}]) for m in FRESH_PROMPTS]
    one = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    copy = SamplingParams(temperature=0.0, max_tokens=args.copy_max_tokens)
    vocab = engine.arch.vocab_size
    trace = generate_workload(
        "sharegpt",
        args.num_inflight,
        0,
        vocab_size=vocab,
        output_median=float(args.sharegpt_output_len),
        max_output_len=4 * args.sharegpt_output_len,
        max_prompt_len=512,
    )
    many = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in trace
    ]
    return {
        "copy": (chat, copy, False),
        "fresh": (fresh, one, False),
        "sharegpt": ([resolve_prompt_token_ids(r, vocab) for r in trace], many, True),
    }


def step_ms_by_rows(records: list[dict[str, float]], max_rows: int = 9) -> dict[int, float]:
    """Median model time (ms, ``execute_seconds``) of the one-request steps in ``records``
    (``LLMEngine.step_records``) by the positions they computed, up to ``max_rows``: a plain
    decode is 1, a verification of ``k`` drafts ``1 + k`` (issue 52: what a draft costs)."""
    by: dict[int, list[float]] = {}
    for r in records:
        rows = int(r["num_prefill_tokens"] + r["num_decode_tokens"])
        if r["num_seqs"] == 1 and rows <= max_rows:
            by.setdefault(rows, []).append(1e3 * r["execute_seconds"])
    return {n: round(statistics.median(v), 2) for n, v in sorted(by.items())}


def draft_spec_config(spec_config: str, draft_model: str | None) -> str:
    """``--spec-config`` as given, or with ``--draft-model``: its keys other than the n-gram
    ones, for a draft model at ``draft_model``."""
    if draft_model is None:
        return spec_config
    keep = {
        k: v
        for k, v in json.loads(spec_config).items()
        if k not in ("method", "prompt_lookup_max", "prompt_lookup_min")
    }
    return json.dumps({**keep, "model": draft_model})


def cmd_spec(args: argparse.Namespace) -> int:
    """Run the three workloads on both engines; print tokens/s and the speed-ups."""
    from kvserve.engine.llm_engine import LLMEngine  # NOTE: lazy: torch

    config = EngineConfig.from_cli_args(args)
    spec_json = draft_spec_config(args.spec_config, args.draft_model)
    spec_config = config.replace(speculative_config=spec_json)
    engines = {"plain": LLMEngine(config.replace(speculative_config=None))}
    engines["spec"] = LLMEngine(spec_config)
    loads = _workloads(engines["plain"], args)
    names = args.workloads or list(loads)
    results: dict[str, Any] = {}
    for name in names:
        prompts, params, at_once = loads[name]
        for engine in engines.values():  # warm-up: kernels, buffers
            _run(engine, prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), False)
        rates: dict[str, list[float]] = {"plain": [], "spec": []}
        outs: dict[str, list] = {}
        first = {kind: len(engine.step_records) for kind, engine in engines.items()}
        for _ in range(args.repeats):
            for kind, engine in engines.items():
                before = engine.stats()
                tokens, seconds, outs[kind] = _run(engine, prompts, params, at_once)
                rates[kind].append(tokens / seconds)
                after = engine.stats()
        by_rows = {k: step_ms_by_rows(e.step_records[first[k] :]) for k, e in engines.items()}
        spec_stats = {
            k: after[k] - before.get(k, 0)
            for k in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
        }
        plain_rate, spec_rate = (statistics.median(rates[k]) for k in ("plain", "spec"))
        results[name] = {
            "plain_tokens_per_s": plain_rate,
            "spec_tokens_per_s": spec_rate,
            "speedup": spec_rate / plain_rate,
            "runs": rates,
            "same_output": outs["plain"] == outs["spec"],
            "step_ms_by_rows": by_rows,
            **spec_stats,
        }
        r = results[name]
        acc = spec_stats["spec_decode_num_accepted_tokens"]
        drafted = spec_stats["spec_decode_num_draft_tokens"]
        print(
            f"{name:9s} plain {plain_rate:7.1f} tok/s  spec {spec_rate:7.1f} tok/s  "
            f"x{r['speedup']:.2f}  drafted {drafted} accepted {acc}  "
            f"same output: {r['same_output']}",
            flush=True,
        )
        if not at_once:
            print(f"          model ms a step by positions computed: {by_rows}", flush=True)
    price = engines["spec"].scheduler.spec.price  # None where the config sets the price
    cost = None if price is None else {"value": price.cost(), "measured": price.measured}
    if cost is not None:
        print(f"draft token cost: {cost['value']:.3f} (measured: {cost['measured']})", flush=True)
    record = make_record("spec", results, spec_config=spec_json, draft_token_cost=cost)
    write_json(args.output_json, record)
    return 0
