"""Paged attention: the fast backends equal the reference, which equals dense attention.

NativeCPUBackend runs the C++ decode kernel where it loads (tests/runtime/test_native.py
fails when it does not) and TorchSDPABackend's path elsewhere."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.outputs import ScheduledRequest, SchedulerOutput
from kvserve.runtime.attention import get_attention_backend, metadata
from kvserve.runtime.attention.metadata import SeqSpec, build_attention_metadata, plan_decode_groups
from kvserve.runtime.attention.native_cpu import NativeCPUBackend
from kvserve.runtime.attention.sdpa import TorchSDPABackend
from kvserve.runtime.attention.torch_ref import TorchReferenceBackend
from kvserve.runtime.input_batch import build_input_batch
from kvserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 64
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 8
# NOTE: fp32 with a different summation order (SDPA kernels vs einsum): ~1e-6 observed.
ATOL = 1e-5


def _dense_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, window: int | None
) -> torch.Tensor:
    """Plain causal attention of q [n, H, d] (positions start..) over keys/values [L, kvh, d]."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, 1)
    values = values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    k_pos = torch.arange(keys.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


def _case(shapes: list[tuple[int, int]], seed: int) -> tuple[dict, list[SeqSpec], torch.Tensor]:
    """Sequences (start_pos, num_new) with random full K/V, shuffled block tables, and a
    cache pre-filled with each sequence's first start_pos tokens."""
    gen = torch.Generator().manual_seed(seed)
    free = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    seqs, full = [], []
    offset = 0
    for start, n in shapes:
        total = start + n
        blocks = [free.pop() for _ in range(-(-total // BLOCK_SIZE))]
        keys = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        values = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        for p in range(start):  # the already-computed context
            cache[0, blocks[p // BLOCK_SIZE], p % BLOCK_SIZE] = keys[p]
            cache[1, blocks[p // BLOCK_SIZE], p % BLOCK_SIZE] = values[p]
        seqs.append(SeqSpec(offset, n, start, blocks))
        full.append((keys, values))
        offset += n
    q = torch.randn(offset, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.cat([kv[0][s.start_pos :] for kv, s in zip(full, seqs, strict=True)])
    v = torch.cat([kv[1][s.start_pos :] for kv, s in zip(full, seqs, strict=True)])
    return {"q": q, "k": k, "v": v, "full": full}, seqs, cache


MIXES = [
    [(0, 1)],  # a one-token prompt
    [(5, 1), (12, 1), (0, 1), (31, 1)],  # decodes only, ragged lengths
    [(0, 9), (0, 16)],  # fresh prefills
    [(7, 6), (4, 1), (0, 3)],  # mid-sequence chunk first, then decode, then prefill
    [(3, 1), (9, 1), (0, 13), (6, 10), (17, 1), (8, 8)],  # mixed, decodes not all leading
]


@pytest.mark.parametrize("group_cost", [None, 0])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("mix", MIXES)
def test_backends_match_dense_attention(
    mix: list[tuple[int, int]], window: int | None, group_cost: int | None, monkeypatch
) -> None:
    if group_cost is not None:  # every distinct decode length in a group of its own
        monkeypatch.setattr(metadata, "DECODE_GROUP_COST_TOKENS", group_cost)
    data, seqs, cache0 = _case(mix, seed=len(mix))
    meta = build_attention_metadata(
        seqs, block_size=BLOCK_SIZE, device=CPU, dtype=torch.float32, sliding_window=window
    )
    expected = torch.cat(
        [
            _dense_attention(
                data["q"][s.token_offset : s.token_offset + s.num_query_tokens],
                kv[0],
                kv[1],
                s.start_pos,
                window,
            )
            for s, kv in zip(seqs, data["full"], strict=True)
        ]
    )
    caches = {}
    for name, backend in [
        ("torch_ref", TorchReferenceBackend()),
        ("torch_sdpa", TorchSDPABackend()),
        ("native", NativeCPUBackend()),
        # chunks of up to 8 rows through the decode kernel, longer ones through SDPA
        ("native_chunks_8", NativeCPUBackend(chunk_kernel_max_tokens=8)),
        ("native_chunks_all", NativeCPUBackend(chunk_kernel_max_tokens=10**6)),
    ]:
        cache = cache0.clone()
        out = backend.forward(data["q"], data["k"], data["v"], cache, meta)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0, msg=name)
        caches[name] = cache
        # Again into a caller's buffer (a layer's workspace): the same result; the native
        # backend returns that buffer, its per-step plan reused from the first call.
        buf = torch.full_like(data["q"], float("nan"))
        again = backend.forward(data["q"], data["k"], data["v"], cache0.clone(), meta, buf)
        assert torch.equal(again, out), name
        if isinstance(backend, NativeCPUBackend):
            assert again is buf, name
    # All wrote exactly the same cache, and every token sits at its block-table slot.
    for name in caches:
        assert torch.equal(caches["torch_ref"], caches[name]), name
    for s, (keys, values) in zip(seqs, data["full"], strict=True):
        for p in range(s.seq_len):
            blk, off = s.block_ids[p // BLOCK_SIZE], p % BLOCK_SIZE
            assert torch.equal(caches["torch_sdpa"][0, blk, off], keys[p])
            assert torch.equal(caches["torch_sdpa"][1, blk, off], values[p])


@pytest.mark.parametrize(
    "backend",
    [
        TorchReferenceBackend(),
        TorchSDPABackend(),
        NativeCPUBackend(),
        NativeCPUBackend(chunk_kernel_max_tokens=10**6),
    ],
)
def test_block_written_this_step_is_readable_by_another_sequence(backend) -> None:
    """Sequence B's context block is filled by sequence A in the same step (prefix hit on
    a block cached this step): B must see A's fresh K/V, so all writes precede all reads."""
    gen = torch.Generator().manual_seed(7)
    shared, own = 3, 9
    keys = torch.randn(6, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    values = torch.randn(6, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    # A computes positions 0..3 into block `shared`; B (listed FIRST) has the same first 4
    # tokens cached in `shared` and computes positions 4..5 into block `own`.
    seqs = [SeqSpec(0, 2, 4, [shared, own]), SeqSpec(2, 4, 0, [shared])]
    q = torch.randn(6, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.cat([keys[4:], keys[:4]])
    v = torch.cat([values[4:], values[:4]])
    meta = build_attention_metadata(seqs, block_size=4, device=CPU, dtype=torch.float32)
    cache = torch.full((2, 16, 4, NUM_KV_HEADS, HEAD_DIM), 1e3)  # stale garbage
    out = backend.forward(q, k, v, cache, meta)
    torch.testing.assert_close(
        out[:2], _dense_attention(q[:2], keys, values, 4, None), atol=ATOL, rtol=0
    )


def test_decode_group_is_leading_run_of_single_token_queries() -> None:
    seqs = [SeqSpec(0, 1, 3, [0]), SeqSpec(1, 1, 8, [1, 2, 3]), SeqSpec(2, 5, 0, [4, 5])]
    meta = build_attention_metadata(seqs, block_size=4, device=CPU, dtype=torch.float32)
    assert meta.num_decode_seqs == 2
    (group,) = meta.decode_groups  # 2 short sequences: not worth two calls
    assert (group.row_start, group.row_end, group.max_blocks) == (0, 2, 3)
    assert group.block_ids.tolist() == [0, 0, 0, 1, 2, 3]  # padded with block 0
    assert meta.slot_mapping.tolist() == [
        3,
        3 * 4 + 0,
        16,
        17,
        18,
        19,
        20,
    ]  # pos 8 -> block_ids[2] = 3
    # lengths 4 and 9: keys beyond each length are masked
    mask = group.mask.view(2, -1)
    assert torch.isinf(mask[0, 4:]).all() and (mask[0, :4] == 0).all()
    assert torch.isinf(mask[1, 9:]).all() and (mask[1, :9] == 0).all()
    assert len(meta.chunks) == 1 and meta.chunks[0].mask is None  # fresh prefill: is_causal


def test_metadata_rejects_short_block_table() -> None:
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        build_attention_metadata(
            [SeqSpec(0, 2, 7, [0, 1])], block_size=4, device=CPU, dtype=torch.float32
        )


def test_unknown_backend_name() -> None:
    assert isinstance(get_attention_backend("torch_ref"), TorchReferenceBackend)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_attention_backend("flash")


def test_one_metadata_serves_caches_of_different_sizes() -> None:
    """The gather rows are kept per cache size: the same step's metadata on a cache with more
    blocks (V blocks start elsewhere in the flat view) still reads the right K and V."""
    mix = [(5, 1), (12, 1), (7, 6)]  # decodes and a chunk with cached context
    data, seqs, cache0 = _case(mix, seed=11)
    meta = build_attention_metadata(seqs, block_size=BLOCK_SIZE, device=CPU, dtype=torch.float32)
    big = torch.zeros(2, 3 * NUM_BLOCKS, *cache0.shape[2:])
    big[:, :NUM_BLOCKS] = cache0
    outs = [
        backend.forward(data["q"], data["k"], data["v"], cache, meta)
        for backend in (
            TorchSDPABackend(),
            NativeCPUBackend(),
            NativeCPUBackend(chunk_kernel_max_tokens=10**6),
        )
        for cache in (cache0.clone(), big.clone(), cache0.clone())
    ]
    expected = TorchReferenceBackend().forward(
        data["q"], data["k"], data["v"], cache0.clone(), meta
    )
    for out in outs:
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    assert sorted(meta.decode_groups[0].gather_rows) == [NUM_BLOCKS, 3 * NUM_BLOCKS]


def test_decode_groups_split_where_padding_costs_more_than_a_call() -> None:
    # 4 rows of 1 block and 2 of 10 (block 16): one group pads 6 x 160 = 960 token-rows
    # (+512 for the call); two groups pad 64 + 320 (+2 x 512): cheaper.
    assert plan_decode_groups([1, 1, 1, 1, 10, 10], 16) == [(0, 4), (4, 6)]
    # 1 and 2 blocks: splitting saves 16 padded rows, less than a call: one group.
    assert plan_decode_groups([1, 1, 2, 2], 16) == [(0, 4)]
    assert plan_decode_groups([3, 3, 3], 16, group_cost_tokens=0) == [(0, 3)]
    assert plan_decode_groups([1, 2, 3], 16, group_cost_tokens=0) == [(0, 1), (1, 2), (2, 3)]
    assert plan_decode_groups([1, 40, 2, 40], 16, group_cost_tokens=0) == [
        (0, 1),
        (1, 2),
        (2, 3),
        (3, 4),
    ]
    assert plan_decode_groups([], 16) == []


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 80), min_size=1, max_size=150),
    st.integers(0, 2048),
    st.booleans(),
)
def test_decode_groups_tile_the_rows_and_never_pad_more(
    blocks: list[int], cost: int, sort: bool
) -> None:
    if sort:
        blocks = sorted(blocks)
    groups = plan_decode_groups(blocks, 16, group_cost_tokens=cost)
    assert groups[0][0] == 0 and groups[-1][1] == len(blocks)
    assert all(a < b for a, b in groups)
    assert all(b == c for (_, b), (c, _) in zip(groups, groups[1:], strict=False))

    def total(gs: list[tuple[int, int]]) -> int:
        return sum((b - a) * max(blocks[a:b]) * 16 + cost for a, b in gs)

    assert total(groups) <= total([(0, len(blocks))])  # never worse than one group
    distinct = len(set(blocks))
    if sort and cost == 0 and distinct <= metadata.MAX_DECODE_SPLIT_POINTS:
        assert total(groups) == sum(blocks) * 16  # no padding at all


def test_input_batch_orders_decodes_by_context_length() -> None:
    def req(rid: str, start: int, n: int) -> ScheduledRequest:
        tokens = list(range(1, start + n + 1))
        return ScheduledRequest(
            request_id=rid,
            token_ids=tokens[start:],
            start_pos=start,
            block_ids=list(range(-(-(start + n) // 4))),
            sample=True,
            sampling_params=SamplingParams(),
            prompt_token_ids=tokens,
            output_token_ids=[],
        )

    sched = SchedulerOutput(
        scheduled=[req("long", 30, 1), req("chunk", 0, 5), req("short", 2, 1), req("mid", 9, 1)]
    )
    batch = build_input_batch(sched, block_size=4, num_blocks=16, device=CPU, dtype=torch.float32)
    assert [r.request_id for r in batch.requests] == ["short", "mid", "long", "chunk"]
    assert [r.request_id for r in batch.sample_requests] == ["short", "mid", "long", "chunk"]
