"""Structured output benchmark: overhead, compile time, validity under preemption.

``kvserve bench structured [--parts overhead compile validity] [flags]``

- overhead: B requests (``--batch``, default 32) at once, greedy, ``--max-tokens`` each; arm
  A unconstrained, arm B every request under the 10-field JSON schema (``TEN_FIELDS``,
  longer than max_tokens, so both arms decode the same number of tokens at the same batch
  size). Arms run interleaved (A B A B ...) on one warm engine; reported per round and as the
  median B/A ratio of output tok/s.
- compile: a fresh grammar compiler: tokenizer conversion once, then cold compiles
  (distinct 10-field schemas; compile + first mask) and cached ones (a cache hit + mask).
- validity: ``--num-requests`` (200) over the 5 schemas of ``SCHEMAS`` on a KV pool of
  ``--num-kv-blocks`` (small: preemption is forced), in each preemption mode; every output
  is parsed and validated with jsonschema.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from kvserve.bench.report import make_record, write_json
from kvserve.bench.structured_schemas import PROMPTS, SCHEMAS, TEN_FIELDS


def _engine(args: argparse.Namespace, **kwargs: Any) -> Any:
    from kvserve.engine.llm_engine import LLMEngine  # NOTE: lazy: torch is slow to import

    return LLMEngine(model=args.model, num_threads=args.num_threads, **kwargs)


def _run_all(engine: Any, prompts: list[list[int]], params: list[Any]) -> tuple[float, list[Any]]:
    """Queue everything, step to the end; (seconds, final outputs in order)."""
    seconds, _cpu, outs = _run_timed(engine, prompts, params)
    return seconds, outs


def _run_timed(
    engine: Any, prompts: list[list[int]], params: list[Any]
) -> tuple[float, float, list[Any]]:
    """Queue everything, step to the end; (wall seconds, process CPU seconds, outputs)."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    finals: dict[str, Any] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return time.perf_counter() - t0, time.process_time() - c0, [finals[i] for i in ids]


def _chat(engine: Any, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def bench_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved A/B of output tok/s: unconstrained vs 10-field schema on every request."""
    from kvserve.sampling_params import SamplingParams
    from kvserve.structured import StructuredOutputsParams

    engine = _engine(args, max_num_seqs=max(64, args.batch))
    topics = ["a user profile", "an order", "a sensor reading", "a product", "an event"]
    prompts = [
        _chat(engine, f"Fill in a record for {topics[i % len(topics)]} number {i} as JSON.")
        for i in range(args.batch)
    ]
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    schema = StructuredOutputsParams(json=TEN_FIELDS)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, structured_outputs=schema
    )
    _run_all(engine, prompts[:4], [constrained] * 4)  # warm-up: kernels, compile, masks
    arms = [("unconstrained", free), ("json_schema", constrained)]
    rounds = []
    for r in range(args.rounds):
        row: dict[str, Any] = {"round": r}
        # NOTE: A B, then B A, ...: a load that drifts during a round favours neither arm.
        for arm, params in arms if r % 2 == 0 else arms[::-1]:
            mask_before = engine.structured.stats.mask_seconds
            num_steps_before = len(engine.step_records)
            seconds, cpu_seconds, outs = _run_timed(engine, prompts, [params] * len(prompts))
            steps = engine.step_records[num_steps_before:]
            num_out = sum(len(o.outputs[0].token_ids) for o in outs)
            row[arm] = {
                "seconds": seconds,
                "cpu_seconds": cpu_seconds,
                "output_tokens": num_out,
                "output_tok_s": num_out / seconds,
                "output_tok_per_cpu_s": num_out / cpu_seconds,
                "num_steps": len(steps),
                "execute_seconds": sum(s["execute_seconds"] for s in steps),
                "mask_seconds": engine.structured.stats.mask_seconds - mask_before,
                "finish_reasons": sorted({o.outputs[0].finish_reason for o in outs}),
            }
        a, b = row["unconstrained"], row["json_schema"]
        row["ratio"] = b["output_tok_s"] / a["output_tok_s"]
        row["cpu_ratio"] = b["output_tok_per_cpu_s"] / a["output_tok_per_cpu_s"]
        rounds.append(row)
        print(
            f"[overhead] round {r}: unconstrained {a['output_tok_s']:.1f} tok/s, json_schema "
            f"{b['output_tok_s']:.1f} tok/s (mask fill {b['mask_seconds'] * 1e3:.0f} ms over "
            f"{b['num_steps']} steps), ratio {row['ratio']:.3f}, per CPU second "
            f"{row['cpu_ratio']:.3f}",
            file=sys.stderr,
        )
    ratio = statistics.median(r["ratio"] for r in rounds)
    cpu_ratio = statistics.median(r["cpu_ratio"] for r in rounds)
    print(
        f"[overhead] B={args.batch}: median constrained/unconstrained output tok/s = {ratio:.3f} "
        f"(wall), {cpu_ratio:.3f} (per process CPU second)"
    )
    return {
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "rounds": rounds,
        "ratio": ratio,
        "cpu_ratio": cpu_ratio,
    }


def bench_compile(args: argparse.Namespace) -> dict[str, Any]:
    """Cold and cached compile times of 10-field schemas (compile + first mask)."""
    import numpy as np

    from kvserve.models.loader import resolve_model
    from kvserve.structured import StructuredOutputsParams
    from kvserve.structured.compiler import GrammarCompiler
    from kvserve.tokenizer import Tokenizer

    path = resolve_model(args.model)
    if os.path.isdir(path):
        tok = Tokenizer.from_loaded(path, None)
    else:
        tok = Tokenizer.from_loaded(os.path.dirname(path), os.path.basename(path))
    vocab = tok.vocab_size
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tok.hf_tokenizer, vocab, tok.eos_token_id)
    tokenizer_s = time.perf_counter() - t0
    row = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)

    def timed(spec: Any) -> float:
        t = time.perf_counter()
        matcher = compiler.compile(spec)
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return time.perf_counter() - t

    specs = []
    for k in range(args.num_schemas):
        schema = json.loads(json.dumps(TEN_FIELDS).replace("field_", f"f{k}_"))
        specs.append(StructuredOutputsParams(json=schema))
    cold = [timed(s) for s in specs]
    cached = [timed(s) for s in specs]
    mask_fill_s, apply_s = _per_step_costs(compiler, tok, specs[0], vocab, args.batch)
    result = {
        "per_step_b": args.batch,
        "mask_fill_ms": mask_fill_s * 1e3,
        "bitmask_apply_ms": apply_s * 1e3,
        "tokenizer_seconds": tokenizer_s,
        "cold_ms": {"median": statistics.median(cold) * 1e3, "max": max(cold) * 1e3},
        "cached_ms": {"median": statistics.median(cached) * 1e3, "max": max(cached) * 1e3},
        "num_schemas": args.num_schemas,
    }
    print(
        f"[compile] per step at B={args.batch}: mask fill {mask_fill_s * 1e3:.2f} ms, "
        f"bitmask apply (clone + mask [B, V] logits) {apply_s * 1e3:.2f} ms (min of 20)"
    )
    print(
        f"[compile] tokenizer {tokenizer_s:.2f} s once; 10-field schema cold "
        f"{result['cold_ms']['median']:.2f} ms (max {result['cold_ms']['max']:.2f}), cached "
        f"{result['cached_ms']['median']:.3f} ms (max {result['cached_ms']['max']:.3f})"
    )
    return result


def _per_step_costs(
    compiler: Any, tok: Any, spec: Any, vocab: int, batch: int
) -> tuple[float, float]:
    """Min-of-20 seconds of the constrained-only work of one step at ``batch`` rows: filling
    the bitmask from matchers in mid-object, and applying it to a copy of [batch, V] logits."""
    import numpy as np
    import torch

    from kvserve.runtime.logits_constraints import RowBitmask, apply_token_bitmask

    prefix = tok.encode('{"f0_field_0":"abc","f0_field_1":12', add_special_tokens=False)
    matchers = []
    for _ in range(batch):
        m = compiler.compile(spec)
        m.consume_tokens(prefix)
        matchers.append(m)
    bitmask = np.zeros((batch, (vocab + 31) // 32), dtype=np.int32)
    logits = torch.randn(batch, vocab)
    fill, apply = [], []
    for _ in range(20):
        t = time.perf_counter()
        for i, m in enumerate(matchers):
            row = bitmask[i]
            m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        fill.append(time.perf_counter() - t)
        t = time.perf_counter()
        masked = logits.clone()
        apply_token_bitmask(masked, RowBitmask(bitmask, list(range(batch))))
        apply.append(time.perf_counter() - t)
    return min(fill), min(apply)


def bench_validity(args: argparse.Namespace) -> dict[str, Any]:
    """Every output of a preempting run parses and validates, in both preemption modes."""
    import jsonschema

    from kvserve.sampling_params import SamplingParams
    from kvserve.structured import StructuredOutputsParams

    results = {}
    for mode in args.preemption_modes:
        engine = _engine(
            args,
            num_kv_blocks=args.num_kv_blocks,
            preemption_mode=mode,
            max_num_seqs=64,
        )
        names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(args.num_requests)]
        prompts = [_chat(engine, PROMPTS[n]) for n in names]
        params = [
            SamplingParams(
                temperature=args.temperature,
                seed=i,
                max_tokens=args.validity_max_tokens,
                structured_outputs=StructuredOutputsParams(json=SCHEMAS[n]),
            )
            for i, n in enumerate(names)
        ]
        seconds, outs = _run_all(engine, prompts, params)
        valid, failures = 0, []
        for name, out in zip(names, outs, strict=True):
            text = out.outputs[0].text
            try:
                jsonschema.validate(json.loads(text), SCHEMAS[name])
                valid += 1
            except (ValueError, jsonschema.ValidationError) as e:
                failures.append({"schema": name, "text": text, "error": str(e)[:200]})
        stats = engine.stats()
        engine.kv_cache_manager.check_integrity()
        results[mode] = {
            "num_requests": len(outs),
            "num_valid": valid,
            "valid_fraction": valid / len(outs),
            "preemptions": stats["preemptions"],
            "matchers_rebuilt": engine.structured.stats.num_rebuilt,
            "rejected_tokens": engine.structured.stats.num_rejected_tokens,
            "seconds": seconds,
            "failures": failures[:5],
        }
        print(
            f"[validity] {mode}: {valid}/{len(outs)} valid, {stats['preemptions']} preemptions, "
            f"{engine.structured.stats.num_rebuilt} matchers rebuilt, {seconds:.1f} s"
        )
    return results


def main(argv: list[str] | None = None) -> int:
    """``kvserve bench structured``."""
    ap = argparse.ArgumentParser(prog="kvserve bench structured", description=__doc__)
    ap.add_argument("--parts", nargs="+", default=["compile", "overhead", "validity"],
                    choices=["compile", "overhead", "validity"])  # fmt: skip
    ap.add_argument("--model", default=None, help="model path (default: the embedded one)")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-schemas", type=int, default=20)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--num-kv-blocks", type=int, default=40)
    ap.add_argument("--validity-max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--preemption-modes", nargs="+", default=["recompute", "swap"],
                    choices=["recompute", "swap"])  # fmt: skip
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    results: dict[str, Any] = {}
    if "compile" in args.parts:
        results["compile"] = bench_compile(args)
    if "overhead" in args.parts:
        results["overhead"] = bench_overhead(args)
    if "validity" in args.parts:
        results["validity"] = bench_validity(args)
    write_json(args.output_json, make_record("structured", results, settings=vars(args)))
    ok = all(r["valid_fraction"] == 1.0 for r in results.get("validity", {}).values())
    return 0 if ok else 1
