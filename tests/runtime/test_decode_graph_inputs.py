"""The persistent, padded inputs of captured decode steps (``runtime/cuda_graphs.py``), run
eagerly on CPU tensors (Triton kernels under ``TRITON_INTERPRET=1``): a decode step through
the padded buffers gives the unpadded step's hidden rows and writes the same cache, and the
padding rows write nothing. The capture and replay themselves are CUDA-only (tests/cuda)."""

from __future__ import annotations

import pytest
import torch

from kvserve.core.outputs import SchedulerOutput
from kvserve.runtime.cuda_graphs import (
    DecodeGraphInputs,
    bucket_for,
    graph_buckets,
    is_pure_decode,
)
from kvserve.runtime.model_runner import ModelRunner
from kvserve.runtime.workspace import Workspace
from tests.runtime.runtime_testutil import (
    ToyAllocator,
    ours_from_hf,
    sched_req,
    tiny_hf_model,
)

# NOTE: TRITON_INTERPRET=1 is set by tests/conftest.py before anything imports triton.
pytest.importorskip("triton")

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64


def test_buckets() -> None:
    assert graph_buckets(1) == [1]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    buckets = graph_buckets(256)
    assert buckets[-1] == 256 and bucket_for(3, buckets) == 4 and bucket_for(256, buckets) == 256
    assert bucket_for(257, buckets) is None


@pytest.mark.parametrize(("window", "sinks"), [(None, 0), (6, 2)])
def test_padded_decode_step_matches_the_eager_step(window: int | None, sinks: int) -> None:
    hf = tiny_hf_model("llama", num_key_value_heads=2)
    model, arch = ours_from_hf(hf, attn_backend="triton", native_ops=False)
    runner = ModelRunner(
        model, arch, num_blocks=64, block_size=BLOCK_SIZE, kv_window=window, kv_sink_tokens=sinks
    )
    with pytest.raises(ValueError, match="CUDA"):
        runner.capture_decode_graphs(8, MAX_MODEL_LEN)
    alloc = ToyAllocator(64, BLOCK_SIZE)
    prompts = {"a": [5, 9, 13, 2, 7, 30, 31], "b": [11, 3], "c": list(range(40, 53))}
    # prefill every prompt but its last token, then one decode step of three rows
    prefill = [
        sched_req(rid, p, 0, len(p) - 1, alloc.ensure(rid, len(p)), False)
        for rid, p in prompts.items()
    ]
    runner.execute(SchedulerOutput(scheduled=prefill))
    decode = [
        sched_req(rid, p, len(p) - 1, len(p), alloc.ensure(rid, len(p)), True)
        for rid, p in prompts.items()
    ]
    batch = runner.prepare_inputs(SchedulerOutput(scheduled=decode))
    assert is_pure_decode(batch)
    caches = runner.kv_cache.layer_caches
    with torch.inference_mode():
        want = model(batch.input_ids, batch.positions, caches, batch.attn_meta, Workspace())
        cache_after_eager = runner.kv_cache.device_cache.clone()
        inputs = DecodeGraphInputs(
            max_rows=8,
            max_blocks=MAX_MODEL_LEN // BLOCK_SIZE,
            block_size=BLOCK_SIZE,
            num_heads=arch.num_attention_heads,
            num_kv_heads=arch.num_key_value_heads,
            max_model_len=MAX_MODEL_LEN,
            device=torch.device("cpu"),
            sliding_window=runner.sliding_window,
            num_sink_tokens=runner.num_sink_tokens,
        )
        inputs.fill(batch, 4)
        assert inputs.slots[3:].tolist() == [-1] * 5  # padding rows write nothing
        meta = inputs.meta(4)
        got = model(inputs.input_ids[:4], inputs.positions[:4], caches, meta, Workspace())
    torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()  # padding rows: finite, never read
    # the real rows rewrite their slots (equal up to the matmuls' row-count rounding); no
    # other slot changed: the padding rows wrote nothing
    flat_now = runner.kv_cache.device_cache.flatten(2, 3)  # [layers, 2, slots, kvh, d]
    flat_eager = cache_after_eager.flatten(2, 3)
    written = torch.zeros(flat_now.shape[2], dtype=torch.bool)
    written[batch.attn_meta.slot_mapping] = True
    assert torch.equal(flat_now[:, :, ~written], flat_eager[:, :, ~written])
    torch.testing.assert_close(flat_now[:, :, written], flat_eager[:, :, written])
    # a smaller step refills the same buffers: the stale row is padded again
    with torch.inference_mode():
        inputs.fill(runner.prepare_inputs(SchedulerOutput(scheduled=decode[:1])), 2)
    assert inputs.slots[1].item() == -1 and inputs.seq_lens[1].item() == 1
    assert inputs.tables[1, 0].item() == 0  # the one column a padding row reads
