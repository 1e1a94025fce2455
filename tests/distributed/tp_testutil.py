"""Run the same greedy requests on an engine at TP=1 and TP=N; record every step's logits."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.core.outputs import ScheduledRequest
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams


class RecordingSampler:
    """Wraps rank 0's Sampler: keeps (request id, output position) -> logits row."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.logits: dict[tuple[str, int], torch.Tensor] = {}

    def sample(self, logits: torch.Tensor, reqs: list[ScheduledRequest]):  # noqa: ANN201
        for row, req in zip(logits, reqs, strict=True):
            self.logits[(req.request_id, len(req.output_token_ids))] = row.detach().clone()
        return self.inner.sample(logits, reqs)

    def drop(self, request_id: str) -> None:
        self.inner.drop(request_id)


@dataclass
class RunResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logits: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    num_preemptions: int = 0
    prefix_hit_rate: float = 0.0


def prompts_5_to_600(
    seed: int, vocab: int, num: int = 6, num_short: int = 0
) -> list[list[int]]:
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
    llm = LLM(model=model, tensor_parallel_size=tp, num_threads=1, **engine_kw)
    engine = llm.engine
    try:
        rank0 = engine.tp.runner if engine.tp is not None else engine.runner
        rec = RecordingSampler(rank0.sampler)
        rank0.sampler = rec
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        return RunResult(
            tokens={o.request_id: list(o.outputs[0].token_ids) for o in outs},
            logits=rec.logits,
            num_preemptions=int(stats.get("preemptions", 0)),
            prefix_hit_rate=float(stats.get("prefix_hit_rate", 0.0)),
        )
    finally:
        if engine.tp is not None:
            engine.tp.shutdown()


@dataclass
class Comparison:
    max_logit_diff: float
    num_positions: int
    num_tokens: int
    num_agree: int
    near_ties: list[float]  # top-2 gap at each first differing position


def compare(a: RunResult, b: RunResult, tol: float) -> Comparison:
    """Logits diff over the positions both runs reached with the same tokens, and greedy
    agreement; a first difference is allowed only where the two best logits of ``a`` are
    closer than ``tol`` (a near-tie that summation order can flip)."""
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
            assert ties[-1] < tol, f"{rid}: tokens differ at {n} with a top-2 gap of {ties[-1]}"
    return Comparison(max_diff, positions, total, agree, ties)
