"""Measure kvserve's own step times on this machine, for calibrating the cost model.

Runs the real engine (the embedded SmolLM2-135M by default, on CPU) over a trace whose steps
cover a spread of shapes (prefill chunks of many sizes, decode batches of many sizes and
context lengths) and returns the engine's per-step records as :class:`StepRecord` s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.sampling_params import SamplingParams
from kvserve.sim.calibrate import StepRecord
from kvserve.sim.workloads import WorkloadRequest, generate_workload, resolve_prompt_token_ids

NUM_WARMUP_STEPS = 2  # NOTE: the first steps pay one-off costs (allocator, kernel selection)


def calibration_workload(num_requests: int = 24, seed: int = 0) -> list[WorkloadRequest]:
    """A trace whose steps span prefill sizes 16..max budget and decode batches 1..16."""
    return generate_workload(
        "random",
        num_requests,
        seed,
        min_prompt_len=16,
        max_prompt_len=768,
        min_output_len=4,
        max_output_len=48,
    )


def measure_engine_steps(
    workload: Sequence[WorkloadRequest] | None = None,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 256,
    num_warmup_steps: int = NUM_WARMUP_STEPS,
    **engine_kwargs: Any,
) -> list[StepRecord]:
    """Run ``workload`` (all at once) through a real LLMEngine; its step records after warm-up.

    ``engine_kwargs`` go to ``LLMEngine`` (e.g. ``model=``, ``num_threads=``).
    """
    from kvserve.engine.llm_engine import LLMEngine  # NOTE: lazy: torch is only needed here

    wl = list(workload) if workload is not None else calibration_workload()
    engine = LLMEngine(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=False,
        **engine_kwargs,
    )
    vocab_size = engine.arch.vocab_size
    for w in wl:
        engine.add_request(
            resolve_prompt_token_ids(w, vocab_size),
            SamplingParams(max_tokens=w.output_len, temperature=0.0, ignore_eos=True),
            request_id=w.request_id,
        )
    while engine.has_unfinished_requests():
        engine.step()
    records = []
    for d in engine.step_records[num_warmup_steps:]:
        if d["num_seqs"] == 0:
            continue
        records.append(
            StepRecord(
                num_prefill_tokens=int(d["num_prefill_tokens"]),
                num_decode_tokens=int(d["num_decode_tokens"]),
                num_context_tokens=int(d["num_context_tokens"]),
                num_seqs=int(d["num_seqs"]),
                seconds=float(d["seconds"]),
            )
        )
    return records
