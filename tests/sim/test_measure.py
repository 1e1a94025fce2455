"""Step records measured on the real engine (embedded SmolLM2-135M, CPU) account for every token."""

from kvserve.sim.measure import measure_engine_steps
from kvserve.sim.workloads import WorkloadRequest


def test_engine_step_records_cover_every_computed_token() -> None:
    wl = [WorkloadRequest("a", 40, 3, 0.0), WorkloadRequest("b", 9, 2, 0.0)]
    # NOTE: greedy chunks (prefill_share=1): the first step is all of a's first chunk.
    recs = measure_engine_steps(
        wl, max_num_batched_tokens=32, num_warmup_steps=0, num_threads=1, prefill_share=1.0
    )
    # each request computes its prompt and all but its last output token
    assert sum(r.num_prefill_tokens + r.num_decode_tokens for r in recs) == 40 + 2 + 9 + 1
    assert (recs[0].num_prefill_tokens, recs[0].num_seqs) == (32, 1)  # the budget caps a chunk
    assert (recs[1].num_prefill_tokens, recs[1].num_seqs) == (8 + 9, 2)
    assert all(r.seconds > 0 and r.num_context_tokens >= r.num_seqs for r in recs)
