"""Kernel scratch: the CPU flash-attention model against the allocations torch really makes,
the planner's use of it, and the start-up GEMM probe."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from kvserve.engine.config import EngineConfig
from kvserve.engine.memory_budget import max_sequence_tokens, plan_step_activations
from kvserve.models.llama import LlamaForCausalLM
from kvserve.runtime import native
from kvserve.runtime.kernel_scratch import (
    GemmShape,
    gemm_shape,
    measure_gemm_scratch,
    sdpa_cpu_flash_scratch_bytes,
)
from kvserve.runtime.memory_plan.planner import plan_activations
from kvserve.runtime.memory_plan.recorder import LifetimeRecorder

FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"


@pytest.fixture(scope="module")
def embedded_arch():  # type: ignore[no-untyped-def]
    from kvserve.models.gguf_loader import gguf_arch_config
    from kvserve.models.gguf_reader import read_gguf
    from kvserve.models.loader import default_model_path

    return gguf_arch_config(read_gguf(default_model_path()))


def _flash_allocations(q, k, v, mask, is_causal) -> list[int]:  # type: ignore[no-untyped-def]
    """Sizes of the allocations made inside the flash kernel itself (outputs excluded)."""
    gqa = q.shape[1] != k.shape[1]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa)
    sizes = []
    for ev in prof.events():
        parent = ev.cpu_parent
        if ev.name == "aten::empty" and parent is not None and parent.name == FLASH:
            sizes.append(ev.cpu_memory_usage)
    return sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("q_len", "kv_len", "masked", "causal", "num_kv_heads", "head_dim"),
    [
        (1, 300, True, False, 3, 64),  # a decode: one query row
        (40, 40, False, True, 3, 64),
        (100, 64, False, False, 3, 64),
        (200, 700, True, False, 1, 64),  # GQA: 3 query heads share one KV head
        (300, 300, False, True, 3, 63),  # odd head_dim: padded when packed
        (800, 1000, False, False, 3, 64),
    ],
)
def test_flash_scratch_model_matches_the_kernel(  # type: ignore[no-untyped-def]
    dtype, q_len, kv_len, masked, causal, num_kv_heads, head_dim
) -> None:
    gen = torch.Generator().manual_seed(0)
    batch, heads = 2, 3
    q = torch.randn(batch, heads, q_len, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, num_kv_heads, kv_len, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, num_kv_heads, kv_len, head_dim, generator=gen).to(dtype)
    mask = torch.zeros(batch, 1, q_len, kv_len, dtype=dtype) if masked else None
    allocated = _flash_allocations(q, k, v, mask, causal)
    # The kernel's own buffers, plus its logsumexp output [B, H, Lq] float32 (an output the
    # planner traces, so the model leaves it out).
    logsumexp = batch * heads * q_len * 4
    assert logsumexp in allocated, allocated
    scratch = sum(allocated) - logsumexp
    threads = torch.get_num_threads()
    assert scratch == sdpa_cpu_flash_scratch_bytes(
        q.shape, k.shape, dtype, threads, is_causal=causal
    )


def test_flash_scratch_grows_with_threads_and_rejects_zero() -> None:
    shape = (1, 4, 1024, 64)
    one = sdpa_cpu_flash_scratch_bytes(shape, shape, torch.float32, 1)
    assert sdpa_cpu_flash_scratch_bytes(shape, shape, torch.float32, 4) == 4 * one
    assert one == (256 * 512 + 2 * 256 + 256 * 64) * 4
    with pytest.raises(ValueError, match="num_threads"):
        sdpa_cpu_flash_scratch_bytes(shape, shape, torch.float32, 0)


def test_recorder_adds_scratch_at_the_attention_op_and_collects_gemms() -> None:
    q = torch.randn(1, 4, 300, 64)
    w = torch.randn(96, 64)
    with LifetimeRecorder(num_threads=3) as rec:
        x = torch.mm(q[0, 0], w.t())  # [300, 96]
        o = F.scaled_dot_product_attention(q, q, q)
        del x, o
    expected = sdpa_cpu_flash_scratch_bytes(q.shape, q.shape, torch.float32, 3)
    assert rec.scratch_bytes == expected
    scratch = [iv for iv in rec.intervals(eager=True) if iv.label.startswith("kernel scratch")]
    assert len(scratch) == 1 and scratch[0].size == expected
    assert scratch[0].start == scratch[0].end  # live at its op only
    assert rec.gemm_shapes == {GemmShape(300, 64, 96, "float32", True)}


def test_gemm_shape_reads_the_right_operand_layout() -> None:
    a = torch.empty(5, 8)
    assert gemm_shape(a, torch.empty(3, 8).t()) == GemmShape(5, 8, 3, "float32", True)
    assert gemm_shape(a, torch.empty(8, 3)) == GemmShape(5, 8, 3, "float32", False)
    assert gemm_shape(a, torch.empty(2, 8, 3)) is None


def test_plan_counts_flash_scratch_and_lists_every_steps_gemms(embedded_arch) -> None:  # type: ignore[no-untyped-def]
    arch = embedded_arch
    plan = plan_activations(
        arch, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=128, max_layers=2,
        num_threads=2, model_factory=LlamaForCausalLM,
    )  # fmt: skip
    assert plan.num_threads == 2
    assert 0 < plan.kernel_scratch_bytes <= plan.eager_peak_bytes
    one = plan_activations(
        arch, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=128, max_layers=2,
        num_threads=1, model_factory=LlamaForCausalLM,
    )  # fmt: skip
    assert one.kernel_scratch_bytes * 2 == plan.kernel_scratch_bytes
    qkv = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim
    ms = {s.m for s in plan.gemm_shapes if s.k == arch.hidden_size and s.n == qkv}
    assert ms == {32, 4}  # the prefill/mixed steps' 32 tokens, the decode step's 4
    logits = {s.m for s in plan.gemm_shapes if s.n == arch.vocab_size}
    assert logits == {1, 4}  # the prefill's one sampling row, the decode step's four


def test_gemm_probe_does_not_count_its_own_operands() -> None:
    shape = GemmShape(256, 512, 4096, "float32", True)
    operand_bytes = (256 * 512 + 512 * 4096 + 256 * 4096) * 4
    got = measure_gemm_scratch([shape])
    assert got is not None  # Linux: /proc/self/statm
    assert 0 <= got < operand_bytes
    assert measure_gemm_scratch([]) == 0


def test_pool_size_bounds_the_planned_context(embedded_arch) -> None:  # type: ignore[no-untyped-def]
    arch = embedded_arch
    kw = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 16}
    assert max_sequence_tokens(EngineConfig(**kw), arch, max_model_len=2048) == 2048
    small = EngineConfig(num_kv_blocks=12, **kw)
    assert max_sequence_tokens(small, arch, max_model_len=2048) == 192
    assert max_sequence_tokens(small, arch, max_model_len=100) == 100
    per_block = 16 * arch.kv_bytes_per_token(4)
    by_bytes = EngineConfig(kv_cache_memory=20 * per_block + 5, **kw)
    assert max_sequence_tokens(by_bytes, arch, max_model_len=2048) == 320
    # Windowed eviction keeps freed entries in the tables: no bound from the pool.
    windowed = dataclasses.replace(small, kv_window=64)
    assert max_sequence_tokens(windowed, arch, max_model_len=2048) == 2048
    # The context gather the plan reserves shrinks with the bound: the prefill chunk's
    # (one sequence) where the native decode kernel reads blocks in place, else the
    # batched decode's (every sequence, padded to the longest).
    big = plan_step_activations(EngineConfig(**kw), arch, max_model_len=2048, max_layers=2)
    bounded = plan_step_activations(small, arch, max_model_len=2048, max_layers=2)
    per_seq = 2 * 2048 * arch.num_key_value_heads * arch.head_dim * 4
    if native.available():
        assert big.peaks_by_step["prefill"] >= per_seq > bounded.peaks_by_step["prefill"]
    else:
        assert big.lower_bound_bytes >= 8 * per_seq > bounded.lower_bound_bytes
