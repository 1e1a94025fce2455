"""Static batching baseline: a batch runs until its longest member is done.

This is the request-level batching of a plain ``generate()`` server, simulated with the same
cost model as the continuous-batching runs so the two are comparable:

- a batch takes up to ``batch_size`` requests that have arrived (it does not wait to fill);
- its prompts are padded to the longest one and prefilled in one step;
- every decode step computes all ``batch_size`` rows, finished ones included (padding), until
  the longest output is done; only then does the next batch start;
- every member's response is complete when the batch ends (e2e), though tokens are produced
  step by step (TTFT, ITL measured on the real tokens).

Memory: a batch must fit the KV pool at its padded size (``max prompt + max output`` tokens per
row); ``batch_size`` is cut to what fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.sim.cost_model import CostModel, StepShape
from kvserve.sim.metrics import LatencyRecorder, latency_summary
from kvserve.sim.workloads import WorkloadRequest


@dataclass
class StaticResult:
    """Measurements of a static-batching run."""

    latency: LatencyRecorder
    duration_s: float
    num_steps: int
    num_batches: int
    padded_token_fraction: float  # computed tokens that were padding

    def summary(self) -> dict[str, float]:
        s = latency_summary(self.latency, self.duration_s)
        s.update(
            num_steps=float(self.num_steps),
            num_batches=float(self.num_batches),
            padded_token_fraction=self.padded_token_fraction,
        )
        return s


def simulate_static(
    workload: Sequence[WorkloadRequest],
    cost_model: CostModel,
    batch_size: int,
    max_kv_tokens: int,
) -> StaticResult:
    """Replay ``workload`` with static batches of up to ``batch_size`` requests.

    Raises ValueError if a single request cannot fit ``max_kv_tokens``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    pending = sorted(workload, key=lambda w: w.arrival_time)
    for w in pending:
        if w.prompt_len + w.output_len > max_kv_tokens:
            raise ValueError(
                f"request {w.request_id} ({w.prompt_len + w.output_len} tokens) does not fit "
                f"the KV pool of {max_kv_tokens} tokens"
            )
    rec = LatencyRecorder()
    now = 0.0
    i = 0
    num_steps = num_batches = 0
    useful = padded = 0
    while i < len(pending):
        if pending[i].arrival_time > now:
            now = pending[i].arrival_time
        batch: list[WorkloadRequest] = []
        max_p = max_o = 0
        while i < len(pending) and pending[i].arrival_time <= now and len(batch) < batch_size:
            w = pending[i]
            p, o = max(max_p, w.prompt_len), max(max_o, w.output_len)
            if batch and (len(batch) + 1) * (p + o) > max_kv_tokens:
                break  # the padded batch would not fit the pool
            batch.append(w)
            max_p, max_o = p, o
            i += 1
        for w in batch:
            rec.arrive(w.request_id, w.arrival_time, w.prompt_len)
        b = len(batch)
        num_batches += 1
        # Prefill: b rows padded to max_p, one step; every row samples its first token.
        prefill = StepShape(
            num_prefill_tokens=b * max_p,
            num_decode_tokens=0,
            num_context_tokens=b * max_p,
            num_seqs=b,
            num_attention_pairs=b * max_p * (max_p + 1) // 2,
            num_sampled=b,
        )
        now += cost_model.step_time(prefill)
        num_steps += 1
        for w in batch:
            rec.token(w.request_id, now)
        useful += sum(w.prompt_len for w in batch)
        padded += b * max_p
        # Decode: max_o - 1 steps of b rows each; row j is useful while it has tokens left.
        for k in range(1, max_o):
            ctx = max_p + k
            step = StepShape(0, b, b * ctx, b, num_attention_pairs=b * ctx, num_sampled=b)
            now += cost_model.step_time(step)
            num_steps += 1
            for w in batch:
                if k < w.output_len:
                    rec.token(w.request_id, now)
                    useful += 1
            padded += b
        for w in batch:
            rec.finish(w.request_id, now)
    return StaticResult(
        latency=rec,
        duration_s=now,
        num_steps=num_steps,
        num_batches=num_batches,
        padded_token_fraction=1.0 - useful / padded if padded else 0.0,
    )
