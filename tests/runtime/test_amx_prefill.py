"""The AMX prefill attention kernel (``kvserve::amx_prefill_attention``,
kvserve/runtime/native/csrc/amx_attention.cpp) against a float64 reference, and the native
backend's use of it: long chunks through the kernel where it serves them, SDPA where not.
Skipped where the kernel does not run (no AMX-BF16 in this build or CPU)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvserve.runtime import native
from kvserve.runtime.attention.metadata import SeqSpec, build_attention_metadata
from kvserve.runtime.attention.native_cpu import NativeCPUBackend, amx_prefill_available

pytestmark = pytest.mark.skipif(
    not amx_prefill_available(), reason="the AMX prefill kernel does not run here"
)

D = 64


def reference(
    q: torch.Tensor,  # [n, H, d]
    cache: torch.Tensor,  # [2, blocks, bs, kvh, d]
    table: list[int],
    ctx: int,
) -> torch.Tensor:  # [n, H, d] float64
    """Causal attention in float64: query row i at position ctx + i sees keys 0 .. ctx + i."""
    n, heads, d = q.shape
    bs, kvh = cache.shape[2], cache.shape[3]
    keys = torch.arange(ctx + n)
    blk, off = torch.tensor(table)[keys // bs], keys % bs
    k = cache[0, blk, off].double().repeat_interleave(heads // kvh, 1)  # [L, H, d]
    v = cache[1, blk, off].double().repeat_interleave(heads // kvh, 1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) / math.sqrt(d)
    hidden = keys[None, :] > (ctx + torch.arange(n))[:, None]
    p = s.masked_fill(hidden[None], float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", p, v)


def run_kernel(q: torch.Tensor, cache: torch.Tensor, table: list[int], ctx: int) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    torch.ops.kvserve.amx_prefill_attention(
        out, q, cache, torch.tensor(table, dtype=torch.int32), ctx, 1 / math.sqrt(q.shape[-1])
    )
    return out


@pytest.mark.parametrize("seed", range(12))
def test_kernel_matches_float64_attention(seed: int) -> None:
    """Random chunk lengths, contexts, block sizes, GQA groups and block tables in any order;
    within bf16 rounding of the exact result (its output is rounded to bf16 once)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    heads, kvh = rng.choice([(9, 3), (4, 4), (8, 1), (6, 2)])
    bs = rng.choice([1, 5, 16, 32])
    n = rng.choice([1, 15, 16, 17, 33, rng.randint(2, 160)])
    ctx = rng.choice([0, rng.randint(1, 200)])
    blocks = -(-(ctx + n) // bs)
    cache = torch.randn(2, blocks + 4, bs, kvh, D, generator=gen).to(torch.bfloat16)
    table = rng.sample(range(blocks + 4), blocks)
    qkv = torch.randn(n, heads + 2 * kvh, D, generator=gen).to(torch.bfloat16)
    q = qkv[:, :heads]  # rows strided as in the model's fused qkv
    out = run_kernel(q, cache, table, ctx)
    torch.testing.assert_close(out.double(), reference(q, cache, table, ctx), atol=2e-2, rtol=0)


def test_large_scores_and_a_growing_max_stay_exact() -> None:
    """Scores that grow along the keys (the running max raised many times) and scores far
    above 1 (a plain exp would overflow): softmax is still exact to bf16."""
    gen = torch.Generator().manual_seed(7)
    n, ctx, bs, kvh, heads = 40, 90, 16, 1, 2
    blocks = -(-(ctx + n) // bs)
    cache = torch.randn(2, blocks, bs, kvh, D, generator=gen)
    cache[0] *= torch.linspace(0.1, 6, blocks * bs).view(blocks, bs, 1, 1)  # growing keys
    cache = cache.to(torch.bfloat16)
    q = (torch.randn(n, heads, D, generator=gen) * 4).to(torch.bfloat16)
    out = run_kernel(q, cache, list(range(blocks)), ctx)
    ref = reference(q, cache, list(range(blocks)), ctx)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=0)


def test_bad_arguments_are_named() -> None:
    cache = torch.zeros(2, 4, 16, 1, D, dtype=torch.bfloat16)
    q = torch.zeros(8, 2, D, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    table = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block id 9 out of range"):
        torch.ops.kvserve.amx_prefill_attention(
            out, q, cache, torch.tensor([9], dtype=torch.int32), 0, 0.125
        )
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        torch.ops.kvserve.amx_prefill_attention(out, q.float(), cache, table, 0, 0.125)
    with pytest.raises(RuntimeError, match="head_dim 64"):
        small = torch.zeros(2, 4, 16, 1, 32, dtype=torch.bfloat16)
        torch.ops.kvserve.amx_prefill_attention(out[..., :32], q[..., :32], small, table, 0, 0.125)
    with pytest.raises(RuntimeError, match="covering 40 keys"):
        torch.ops.kvserve.amx_prefill_attention(out, q, cache, table, 32, 0.125)


def step(
    *, window: int | None = None, dtype: torch.dtype = torch.bfloat16, d: int = D
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, object]:
    """A mixed step: two decodes, a fresh 40-token prompt and a 30-token chunk after 50 cached
    tokens; its q, k, v, cache and metadata."""
    gen = torch.Generator().manual_seed(11)
    bs, kvh, heads = 16, 2, 6
    seqs = [
        SeqSpec(0, 1, 20, [0, 1]),
        SeqSpec(1, 1, 7, [2]),
        SeqSpec(2, 40, 0, [3, 4, 5]),
        SeqSpec(42, 30, 50, [6, 7, 8, 9, 10]),
    ]
    meta = build_attention_metadata(
        seqs, block_size=bs, device=torch.device("cpu"), dtype=dtype, sliding_window=window
    )
    cache = torch.randn(2, 11, bs, kvh, d, generator=gen).to(dtype)
    qkv = torch.randn(72, heads + 2 * kvh, d, generator=gen).to(dtype)
    return qkv[:, :heads], qkv[:, heads : heads + kvh], qkv[:, heads + kvh :], cache, meta


class CountingOps:
    """``torch.ops.kvserve`` with the AMX prefill kernel's calls counted (rows per call)."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __getattr__(self, name: str) -> object:
        return getattr(torch.ops.kvserve, name)

    def amx_prefill_attention(self, out: torch.Tensor, q: torch.Tensor, *args: object) -> None:
        self.calls.append(q.shape[0])
        torch.ops.kvserve.amx_prefill_attention(out, q, *args)


def test_backend_sends_long_chunks_through_the_kernel(monkeypatch) -> None:
    """With ``chunk_amx`` the two chunks run the kernel (the decodes the decode kernel): the
    output agrees with the SDPA path within bf16 rounding."""
    q, k, v, cache, meta = step()
    sdpa = NativeCPUBackend(chunk_kernel_max_tokens=16).forward(q, k, v, cache.clone(), meta)
    ops = CountingOps()
    monkeypatch.setattr(native, "ops", lambda: ops)
    amx = NativeCPUBackend(chunk_kernel_max_tokens=16, chunk_amx=True)
    out = amx.forward(q, k, v, cache.clone(), meta)
    assert ops.calls == [40, 30]
    torch.testing.assert_close(out.float(), sdpa.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(out[:2], sdpa[:2], atol=0, rtol=0)  # decodes: the same kernel


@pytest.mark.parametrize(
    "kind", ["sliding_window", "float32", "head_dim_32"], ids=lambda kind: kind
)
def test_backend_falls_back_to_sdpa_where_the_kernel_cannot_serve(kind: str) -> None:
    q, k, v, cache, meta = step(
        window=24 if kind == "sliding_window" else None,
        dtype=torch.float32 if kind == "float32" else torch.bfloat16,
        d=32 if kind == "head_dim_32" else D,
    )
    sdpa = NativeCPUBackend().forward(q, k, v, cache.clone(), meta)
    amx = NativeCPUBackend(chunk_amx=True).forward(q, k, v, cache.clone(), meta)
    assert not NativeCPUBackend.amx_serves(q, cache, meta)
    torch.testing.assert_close(amx, sdpa, atol=0, rtol=0)


def test_memory_plan_counts_the_kernels_scratch() -> None:
    """A prefill step whose chunk runs the kernel: the plan holds its packed context and
    per-thread buffers (``amx_prefill_scratch_bytes``) at that op, not SDPA's gathered copy."""
    from kvserve.config import ModelArchConfig
    from kvserve.models.llama import LlamaForCausalLM
    from kvserve.runtime.kernel_scratch import amx_prefill_scratch_bytes
    from kvserve.runtime.memory_plan.planner import plan_activations
    from kvserve.runtime.native.chunk_limit import ChunkAttention

    arch = ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=128, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=D,
        max_position_embeddings=256,
    )  # fmt: skip
    common = dict(
        max_num_batched_tokens=32, max_num_seqs=1, max_model_len=200, block_size=16,
        dtype=torch.bfloat16, steps=["prefill"], num_threads=2, attn_backend="native",
        model_factory=LlamaForCausalLM,
    )  # fmt: skip
    plan = plan_activations(arch, chunk_attention=ChunkAttention(0, False, True), **common)
    # the 32-token chunk at the end of a 200-token context: 7 steps of 32 keys
    assert plan.kernel_scratch_bytes == amx_prefill_scratch_bytes(1, 200, 2)
    assert amx_prefill_scratch_bytes(1, 200, 2) == 7 * 8192 + 64 + 2 * 9216
    sdpa = plan_activations(arch, chunk_attention=ChunkAttention(0, False, False), **common)
    assert sdpa.kernel_scratch_bytes != plan.kernel_scratch_bytes
