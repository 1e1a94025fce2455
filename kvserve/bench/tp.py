"""``kvserve bench tp``: tensor parallel (gloo) against one process on the same requests.

Runs the same greedy requests (prompts of 5-600 tokens, two sharing a 300-token prefix, plus
short ones that make a small pool preempt) on an engine at TP=1 and at each ``--tp`` size,
recording rank 0's logits at every sampled position. Prints per size: the largest logits
difference over the positions both runs reached with the same tokens, greedy agreement (and
the top-2 gap where the first token differs), the median decode step time and the share of
rank 0's step spent in all-reduces / the logits gather (waiting for the slowest rank included).

Example: ``kvserve bench tp --tp 3`` (embedded model, 3 ranks; on a machine with fewer cores
than ranks set ``KVSERVE_TP_ALLOW_OVERSUBSCRIBE=1``: the step times then measure contention).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvserve.core.outputs import ScheduledRequest


class RecordingSampler:
    """Wraps rank 0's Sampler: keeps (request id, output position) -> logits row."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.vocab_size: int = inner.vocab_size
        self.logits: dict[tuple[str, int], torch.Tensor] = {}
        self.fast_path_rows = 0  # rows the greedy fast path sampled

    def _record(self, logits: torch.Tensor, reqs: list[ScheduledRequest]) -> None:
        for row, req in zip(logits, reqs, strict=True):
            self.logits[(req.request_id, len(req.output_token_ids))] = row.detach().clone()

    def sample(
        self, logits: torch.Tensor, reqs: list[ScheduledRequest], token_bitmask: Any = None
    ) -> Any:
        """Record each row, then sample as the wrapped sampler does."""
        self._record(logits, reqs)
        return self.inner.sample(logits, reqs, token_bitmask)

    def sample_greedy_checked(
        self, logits: torch.Tensor, reqs: list[ScheduledRequest], token_bitmask: Any = None
    ) -> Any:
        """The wrapped sampler's greedy fast path; records the rows it sampled.

        NOTE: without it the guard fell back to ``sample`` on every step (an AttributeError),
        so the runs compared and timed here were not the engine's own path."""
        out = self.inner.sample_greedy_checked(logits, reqs, token_bitmask)
        if out is not None:
            self._record(logits, reqs)
            self.fast_path_rows += len(reqs)
        return out


@dataclass
class RunResult:
    """What one engine run produced."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logits: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    num_preemptions: int = 0
    prefix_hit_rate: float = 0.0
    decode_step_s: float = 0.0  # median execute time of pure-decode steps
    all_reduce_share: float = 0.0  # rank 0: collective seconds / execute seconds
    startup_s: float = 0.0
    fast_path_rows: int = 0  # rank 0: rows sampled by the greedy fast path


def prompts_5_to_600(seed: int, vocab: int, num: int = 6, num_short: int = 0) -> list[list[int]]:
    """Token-id prompts of 5..600 tokens (two share a 300-token prefix: prefix cache hits),
    then ``num_short`` 20-token ones (many growing requests: preemption in a small pool)."""
    rng = random.Random(seed)
    lens = [5, 37, 140, 600, 333, 321][:num] + [20] * num_short
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in lens]
    if num >= 6:
        prompts[5] = prompts[4][:300] + prompts[5][300:]
    return prompts


def run_engine(
    model: str | None, tp: int, prompts: list[list[int]], max_tokens: int, **engine_kw: Any
) -> RunResult:
    """Greedy generation on a fresh engine; the TP group is shut down before returning."""
    from kvserve.engine.llm import LLM
    from kvserve.sampling_params import SamplingParams

    engine_kw.setdefault("num_threads", 1)
    engine_kw.setdefault("dtype", "float32")  # the comparison is stated in fp32
    # NOTE: a TP group runs dense weights (engine_startup), so the one-process run it is
    # compared with must too: the default `--quantization auto` keeps a GGUF quantized.
    engine_kw.setdefault("quantization", "none")
    t0 = time.perf_counter()
    llm = LLM(model=model, tensor_parallel_size=tp, **engine_kw)
    startup = time.perf_counter() - t0
    engine = llm.engine
    try:
        rank0 = engine.tp.runner if engine.tp is not None else engine.runner
        rec = RecordingSampler(rank0.sampler)
        rank0.sampler = rec
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        steps = engine.step_records
        decode = [s["execute_seconds"] for s in steps if s["num_prefill_tokens"] == 0]
        total_exec = sum(s["execute_seconds"] for s in steps)
        coll = engine.tp.group.all_reduce_seconds if engine.tp is not None else 0.0
        return RunResult(
            tokens={o.request_id: list(o.outputs[0].token_ids) for o in outs},
            logits=rec.logits,
            num_preemptions=int(stats.get("preemptions", 0)),
            prefix_hit_rate=float(stats.get("prefix_hit_rate", 0.0)),
            decode_step_s=statistics.median(decode) if decode else float("nan"),
            all_reduce_share=coll / total_exec if total_exec else 0.0,
            startup_s=startup,
            fast_path_rows=rec.fast_path_rows,
        )
    finally:
        if engine.tp is not None:
            engine.tp.shutdown()


@dataclass
class Comparison:
    """Logits and greedy agreement of run b against run a."""

    max_logit_diff: float
    num_positions: int
    num_tokens: int
    num_agree: int
    near_ties: list[float]  # top-2 gap of a's logits at each first differing position


def compare(a: RunResult, b: RunResult, tol: float | None = None) -> Comparison:
    """Logits diff over the positions both runs reached with the same tokens, and greedy
    agreement. With ``tol``, a first difference is allowed only where a's two best logits
    are closer than ``tol`` (a near-tie that summation order can flip): AssertionError else."""
    max_diff, positions, total, agree, ties = 0.0, 0, 0, 0, []
    for rid, ta in a.tokens.items():
        tb = b.tokens[rid]
        total += len(ta)
        n = 0
        while n < len(ta) and ta[n] == tb[n]:
            n += 1
        agree += n
        for pos in range(min(n + 1, len(ta))):
            la, lb = a.logits[(rid, pos)], b.logits[(rid, pos)]
            max_diff = max(max_diff, float((la - lb).abs().max()))
            positions += 1
        if n < len(ta):
            top2 = a.logits[(rid, n)].topk(2).values
            ties.append(float(top2[0] - top2[1]))
            if tol is not None and ties[-1] >= tol:
                raise AssertionError(f"{rid}: tokens differ at {n} with a top-2 gap {ties[-1]}")
    return Comparison(max_diff, positions, total, agree, ties)


def main(argv: list[str] | None = None) -> int:
    """Run TP=1 and each ``--tp`` size; print one row each."""
    p = argparse.ArgumentParser(prog="kvserve bench tp", description=__doc__)
    p.add_argument("--model", default=None, help="model path (default: the embedded model)")
    p.add_argument("--tp", type=int, nargs="+", default=[3])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-short", type=int, default=10, help="20-token prompts added")
    p.add_argument("--num-kv-blocks", type=int, default=96)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    prompts = prompts_5_to_600(args.seed, 49152, num_short=args.num_short)
    kw = {
        "num_kv_blocks": args.num_kv_blocks,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_threads": args.num_threads,
    }
    base = run_engine(args.model, 1, prompts, args.max_tokens, **kw)
    rows: list[dict[str, Any]] = []
    print(
        f"{len(prompts)} prompts (5-600 tokens), {args.max_tokens} greedy tokens each; "
        f"TP=1: decode step {base.decode_step_s * 1e3:.1f} ms, preemptions "
        f"{base.num_preemptions}, prefix hit rate {base.prefix_hit_rate:.3f}"
    )
    print("| TP | max logits diff | greedy agreement | top-2 gaps at divergence | decode step ms "
          "| vs TP=1 | all-reduce share |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for n in args.tp:
        res = run_engine(args.model, n, prompts, args.max_tokens, **kw)
        c = compare(base, res)
        row = {
            "tp": n,
            **asdict(c),
            "decode_step_s": res.decode_step_s,
            "decode_step_s_tp1": base.decode_step_s,
            "all_reduce_share": res.all_reduce_share,
            "num_preemptions": res.num_preemptions,
            "prefix_hit_rate": res.prefix_hit_rate,
        }
        rows.append(row)
        gaps = ", ".join(f"{g:.2e}" for g in c.near_ties) or "none"
        print(
            f"| {n} | {c.max_logit_diff:.2e} | {c.num_agree}/{c.num_tokens} | {gaps} | "
            f"{res.decode_step_s * 1e3:.1f} | {res.decode_step_s / base.decode_step_s:.2f}x | "
            f"{res.all_reduce_share:.1%} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
