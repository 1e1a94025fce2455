"""Paged attention over the block-structured KV cache.

Cache layout (one tensor per layer): ``[2, num_blocks, block_size, num_kv_heads, head_dim]``;
index 0 holds K, index 1 holds V. A token at position ``p`` of a sequence lives in block
``block_ids[p // block_size]`` at offset ``p % block_size``, i.e. at flat slot
``block_ids[p // block_size] * block_size + p % block_size`` of the cache viewed as
``[2, num_blocks * block_size, num_kv_heads, head_dim]``.

Every backend first writes the K/V of ALL new tokens of the step into the cache, and only
then attends. NOTE: the scheduler relies on this order: a block filled by one request in this
step may already be matched from the prefix cache (and read) by another request in the same
step.

Two backends share one call, ``forward(q, k, v, kv_cache, meta)``:

- ``TorchReferenceBackend``: exact and simple; per sequence it computes slots from the block
  table in Python, gathers K/V token by token and runs explicit masked softmax attention.
- ``TorchSDPABackend``: the fast path. The single-token queries (decodes) of the step run
  in a few batches ("decode groups", see ``plan_decode_groups``): per group, whole blocks are
  gathered into ``[B_g, max_len_g, kv_heads, head_dim]`` and one SDPA call attends with a
  length mask (the GQA query heads of one KV head ride in SDPA's query axis). Multi-token
  chunks run one SDPA call each: a chunk starting at position 0 attends its own fresh K/V
  with ``is_causal``; a chunk starting mid-sequence gathers its context from the cache and
  uses an offset causal mask.

All metadata (slot mapping, gather indices, masks) is built once per step and shared by
every layer: by ``build_attention_metadata``, except the decodes' per-backend views (the SDPA
decode groups, the native kernel's block tables), which ``AttentionMetadata`` makes on first
use.

Windowed attention with sinks (StreamingLLM): with ``sliding_window`` W and
``num_sink_tokens`` S, the query at position p attends to keys k <= p with k < S or
k > p - W. Positions stay absolute: RoPE was applied to each key at write time with its true
position, and queries use their true positions. Blocks that fall out of the window may have
been freed by the core: their block-table entries are ``NULL_BLOCK_ID`` (-1); gathers read
block 0 in their place and the mask hides them.

Quantized caches (``QuantizedLayerCache``, int8 or fp8 with a scale per token per KV head):
new K/V are quantized on write and every read dequantizes to the compute dtype. NOTE: a
chunk that starts at position 0 attends the dequantized values of its own fresh K/V, so both
backends see exactly what later steps will read from the cache.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.runtime.kv_cache import QuantizedLayerCache, dequantize_kv, quantize_kv

NULL_BLOCK_ID = -1  # a block-table entry whose block was freed (out of the window)
LayerCache = torch.Tensor | QuantizedLayerCache


@dataclass(slots=True)
class SeqSpec:
    """One sequence's share of the flat batch (host-side, plain ints)."""

    token_offset: int  # first row of this sequence in the flat [T, ...] batch
    num_query_tokens: int  # new tokens computed this step
    start_pos: int  # position of the first new token (== tokens already in the cache)
    block_ids: list[int]  # block table; covers start_pos + num_query_tokens tokens

    @property
    def seq_len(self) -> int:
        """Context length after this step (cached + new tokens)."""
        return self.start_pos + self.num_query_tokens


@dataclass(slots=True)
class ChunkMeta:
    """Fast-path data for one multi-token query chunk."""

    token_offset: int
    num_query_tokens: int
    start_pos: int
    # Block ids to gather the whole context [0, seq_len) from; None when the chunk starts at
    # position 0 and attends its own fresh K/V.
    ctx_block_ids: torch.Tensor | None  # [num_ctx_blocks] long
    seq_len: int
    # Additive mask [num_query_tokens, ctx_len] (0 / -inf); None = plain causal (is_causal).
    mask: torch.Tensor | None
    # Row ids of ``ctx_block_ids`` for the gather, by cache size (see ``_gather_rows``).
    gather_rows: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class DecodeGroup:
    """Fast-path data for a run of decode rows ``[row_start, row_end)`` batched together."""

    row_start: int
    row_end: int
    block_ids: torch.Tensor  # [num_seqs * max_blocks] long, padded with block 0
    max_blocks: int  # the longest sequence of the group, in blocks
    mask: torch.Tensor  # [num_seqs, 1, 1, max_blocks * block_size] additive (0 / -inf)
    # Row ids of ``block_ids`` for the gather, by cache size (see ``_gather_rows``).
    gather_rows: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step; built once, shared by all layers."""

    block_size: int
    seqs: list[SeqSpec]  # in flat-batch order
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot of each new token
    sliding_window: int | None = None
    num_sink_tokens: int = 0  # with sliding_window: the first S positions stay visible
    # Fast path: the leading run of sequences with one query token each (decodes).
    num_decode_seqs: int = 0
    chunks: list[ChunkMeta] = field(default_factory=list)  # the other sequences
    dtype: torch.dtype = torch.float32  # of the masks
    # NOTE: the decodes' views for each backend are made on first use (then shared by every
    # layer): a step pays only for the one its backend reads.
    _decode_groups: list[DecodeGroup] | None = None
    _decode_tables: tuple[torch.Tensor, torch.Tensor] | None = None
    _query_tables: tuple[torch.Tensor, torch.Tensor] | None = None
    # What a backend derives from this metadata once and reuses in every layer of the step.
    backend_plans: dict[str, object] = field(default_factory=dict)

    @property
    def decode_groups(self) -> list[DecodeGroup]:
        """TorchSDPABackend's decode groups: runs of consecutive decode rows, each padded to
        its own longest (``plan_decode_groups``)."""
        if self._decode_groups is None:
            dec = self.seqs[: self.num_decode_seqs]
            bs = self.block_size
            blocks = [-(-s.seq_len // bs) for s in dec]
            self._decode_groups = [
                _decode_group_meta(
                    dec[start:end],
                    start,
                    bs,
                    self.slot_mapping.device,
                    self.dtype,
                    self.sliding_window,
                    self.num_sink_tokens,
                )
                for start, end in plan_decode_groups(blocks, bs)
            ]
        return self._decode_groups

    @property
    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """NativeCPUBackend's ``[num_decode, max_blocks]`` int32 block tables and
        ``[num_decode]`` int32 lengths. Rows shorter than the longest are padded with 0
        (never read: past their length); freed entries stay ``NULL_BLOCK_ID``."""
        if self._decode_tables is None:
            dec = self.seqs[: self.num_decode_seqs]
            self._decode_tables = _row_tables(dec, self.block_size, self.slot_mapping.device)
        return self._decode_tables

    @property
    def query_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query row: ``[num_tokens, max_blocks]`` int32 block tables (each row its
        sequence's, padded with 0) and ``[num_tokens]`` int32 lengths (a row at position p
        sees ``p + 1`` tokens, causal): every row as a decode query of
        ``paged_decode_attention``, chunk rows included."""
        if self._query_tables is None:
            device = self.slot_mapping.device
            self._query_tables = _row_tables(self.seqs, self.block_size, device)
        return self._query_tables


def _row_tables(
    seqs: Sequence[SeqSpec], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, max_blocks]`` int32 block tables and ``[rows]`` int32 lengths, one row per
    query token of ``seqs`` (its sequence's table padded with 0; a token at position p sees
    ``p + 1`` tokens). A decode's one row sees its whole ``seq_len``."""
    width = max((-(-s.seq_len // block_size) for s in seqs), default=0)
    table: list[list[int]] = []
    lens: list[int] = []
    for s in seqs:
        row = s.block_ids[:width] + [0] * (width - len(s.block_ids[:width]))
        table.extend([row] * s.num_query_tokens)
        lens.extend(range(s.start_pos + 1, s.seq_len + 1))
    return (
        torch.tensor(table, dtype=torch.int32, device=device).view(len(lens), width),
        torch.tensor(lens, dtype=torch.int32, device=device),
    )


def _slots_for(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions [start, end) through a block table."""
    written = block_ids[start // block_size : (end - 1) // block_size + 1]
    if NULL_BLOCK_ID in written:
        raise ValueError(f"new tokens [{start}, {end}) would be written into a freed block")
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


def _readable(block_ids: list[int]) -> list[int]:
    """The block table with freed entries read as block 0 (masked out by the caller)."""
    return [0 if b == NULL_BLOCK_ID else b for b in block_ids]


def _visible(
    q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None, num_sink_tokens: int
) -> torch.Tensor:
    """Boolean mask: causal, within the window (if any) or among the first sink positions."""
    valid = k_pos <= q_pos
    if sliding_window is not None:
        in_window = k_pos > q_pos - sliding_window
        if num_sink_tokens:
            in_window |= k_pos < num_sink_tokens
        valid &= in_window
    return valid


# NOTE: what one more decode group costs, in padded token-rows: a group adds a gather and an
# SDPA call per layer, worth a few hundred token-rows of gather + attention (the
# measurements: bench/README.md, "Measurements behind constants in the code").
DECODE_GROUP_COST_TOKENS = 512
# The planner is quadratic in the number of distinct lengths; past this many it considers
# only this many evenly spaced split points (a group boundary anywhere else is never needed
# for correctness, only for less padding).
MAX_DECODE_SPLIT_POINTS = 48


def plan_decode_groups(
    num_blocks: list[int],
    block_size: int,
    group_cost_tokens: int | None = None,
) -> list[tuple[int, int]]:
    """Split decode rows into runs ``[(start, end), ...]`` that each pad to their longest.

    ``num_blocks[i]`` is row i's context length in blocks. A run costs its padded token-rows
    (``(end - start) * max(num_blocks[start:end]) * block_size``) plus ``group_cost_tokens``
    (default ``DECODE_GROUP_COST_TOKENS``); the split minimizes the total over runs that
    start where the length changes (dynamic programming). Rows sorted by length (as
    ``build_input_batch`` orders decodes) make that the best split of the batch; any order
    gives a correct one.
    """
    if group_cost_tokens is None:
        group_cost_tokens = DECODE_GROUP_COST_TOKENS
    n = len(num_blocks)
    if n == 0:
        return []
    cuts = [0] + [i for i in range(1, n) if num_blocks[i] != num_blocks[i - 1]]
    if len(cuts) > MAX_DECODE_SPLIT_POINTS:
        step = len(cuts) / MAX_DECODE_SPLIT_POINTS
        cuts = sorted({cuts[int(k * step)] for k in range(MAX_DECODE_SPLIT_POINTS)})
    cuts.append(n)
    m = len(cuts) - 1
    run_max = [max(num_blocks[cuts[k] : cuts[k + 1]]) for k in range(m)]
    best = [0.0] + [math.inf] * m  # best[i]: cost of rows [0, cuts[i])
    prev = [0] * (m + 1)
    for i in range(1, m + 1):
        longest = 0
        for j in range(i - 1, -1, -1):  # a group of runs j .. i-1
            longest = max(longest, run_max[j])
            cost = best[j] + (cuts[i] - cuts[j]) * longest * block_size + group_cost_tokens
            if cost < best[i]:
                best[i], prev[i] = cost, j
    groups = []
    i = m
    while i > 0:
        groups.append((cuts[prev[i]], cuts[i]))
        i = prev[i]
    return groups[::-1]


def _decode_group_meta(
    dec: list[SeqSpec],
    row_start: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    sliding_window: int | None,
    num_sink_tokens: int,
) -> DecodeGroup:
    """Gather ids and length mask for decode sequences ``dec`` (rows from ``row_start``)."""
    max_blocks = max(-(-s.seq_len // block_size) for s in dec)
    # NOTE: pad with block 0: its content is masked out (all cache values are finite).
    table = [
        _readable(s.block_ids[:max_blocks]) + [0] * (max_blocks - len(s.block_ids)) for s in dec
    ]
    seq_lens = torch.tensor([s.seq_len for s in dec], dtype=torch.long, device=device)
    key_pos = torch.arange(max_blocks * block_size, device=device)  # [L]
    valid = _visible(seq_lens[:, None] - 1, key_pos[None, :], sliding_window, num_sink_tokens)
    mask = torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill_(~valid, -math.inf)
    return DecodeGroup(
        row_start=row_start,
        row_end=row_start + len(dec),
        block_ids=torch.tensor(table, dtype=torch.long, device=device).view(-1),
        max_blocks=max_blocks,
        mask=mask.view(len(dec), 1, 1, -1),  # [B_g, 1, 1, L]
    )


def build_attention_metadata(
    seqs: list[SeqSpec],
    *,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    num_sink_tokens: int = 0,
) -> AttentionMetadata:
    """Build the slot mapping, decode gather indices and masks for one step.

    With ``sliding_window`` W, a query at position p sees keys in (p - W, p] plus the first
    ``num_sink_tokens`` positions (attention sinks). Block-table entries ``NULL_BLOCK_ID``
    (freed, out of the window) are allowed only where no query can see them.

    ``seqs`` must tile the flat batch in order (offsets 0, n0, n0+n1, ...). Sequences with one
    query token at the head of the list form the batched decode groups; put decodes first, by
    length, for the fast path (any order is correct).
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if num_sink_tokens < 0:
        raise ValueError(f"num_sink_tokens must be >= 0, got {num_sink_tokens}")
    slots: list[int] = []
    offset = 0
    for s in seqs:
        if s.token_offset != offset:
            raise ValueError(
                f"seqs must tile the batch in order: offset {s.token_offset} != {offset}"
            )
        if s.num_query_tokens < 1:
            raise ValueError("every sequence must have at least one query token")
        end = s.seq_len
        if len(s.block_ids) * block_size < end:
            raise ValueError(
                f"block table of {len(s.block_ids)} blocks cannot hold {end} tokens "
                f"(block_size {block_size})"
            )
        slots.extend(_slots_for(s.block_ids, s.start_pos, end, block_size))
        offset += s.num_query_tokens
    meta = AttentionMetadata(
        block_size=block_size,
        seqs=seqs,
        num_tokens=offset,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        sliding_window=sliding_window,
        num_sink_tokens=num_sink_tokens if sliding_window is not None else 0,
        dtype=dtype,
    )
    sinks = meta.num_sink_tokens
    num_decode = 0
    while num_decode < len(seqs) and seqs[num_decode].num_query_tokens == 1:
        num_decode += 1
    neg_inf = float("-inf")
    meta.num_decode_seqs = num_decode
    for s in seqs[num_decode:]:
        n, start, end = s.num_query_tokens, s.start_pos, s.seq_len
        needs_window = sliding_window is not None and end > sliding_window
        ctx_block_ids = None
        mask = None
        if start > 0:
            num_ctx_blocks = -(-end // block_size)
            ctx_block_ids = torch.tensor(
                _readable(s.block_ids[:num_ctx_blocks]), dtype=torch.long, device=device
            )
        if start > 0 or needs_window:
            ctx_len = end if start == 0 else -(-end // block_size) * block_size
            q_pos = torch.arange(start, end, device=device)[:, None]  # [n, 1]
            k_pos = torch.arange(ctx_len, device=device)[None, :]  # [1, ctx_len]
            valid = _visible(q_pos, k_pos, sliding_window, sinks)
            mask = torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill_(
                ~valid, neg_inf
            )
        meta.chunks.append(ChunkMeta(s.token_offset, n, start, ctx_block_ids, end, mask))
    return meta


class AttentionBackend(abc.ABC):
    """Paged attention: write new K/V into the cache, then attend through block tables.

    Invariants every backend keeps:
    - the K/V of all ``meta.num_tokens`` new tokens are written to their slots before any
      query of the step reads the cache;
    - query ``i`` of a sequence (position ``start_pos + i``) attends exactly to positions
      ``<= start_pos + i`` of its own sequence (and within ``sliding_window`` if set);
    - the result equals ``TorchReferenceBackend`` up to float summation order.
    """

    name: str = "abstract"

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: LayerCache,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,  # [T, num_heads, head_dim] scratch, q's dtype
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k/v into ``kv_cache`` and return attention output for ``q``.

        ``out``: a buffer the backend may write the result into (and return) instead of
        allocating one; the caller reads only the returned tensor.
        """


class TorchReferenceBackend(AttentionBackend):
    """Exact, simple paged attention: Python block-table lookups, explicit softmax."""

    name = "torch_ref"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerCache,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bs = meta.block_size
        device = kv_cache.device
        num_heads, head_dim = q.shape[1], q.shape[2]
        group = num_heads // k.shape[1]
        # 1) write every new token of every sequence.
        for s in meta.seqs:
            pos = range(s.start_pos, s.seq_len)
            blk = torch.tensor([s.block_ids[p // bs] for p in pos], device=device)
            off = torch.tensor([p % bs for p in pos], device=device)
            rows = slice(s.token_offset, s.token_offset + s.num_query_tokens)
            _write_tokens(kv_cache, blk, off, k[rows], v[rows])
        # 2) attend, reading K/V back through the block tables.
        out = torch.empty_like(q) if out is None else out
        scale = 1.0 / math.sqrt(head_dim)
        for s in meta.seqs:
            pos = range(s.seq_len)
            table = _readable(s.block_ids)
            blk = torch.tensor([table[p // bs] for p in pos], device=device)
            off = torch.tensor([p % bs for p in pos], device=device)
            keys, values = _read_tokens(kv_cache, blk, off, q.dtype)  # [L, kvh, d] each
            keys = keys.repeat_interleave(group, dim=1)  # [L, H, d]
            values = values.repeat_interleave(group, dim=1)  # [L, H, d]
            rows = slice(s.token_offset, s.token_offset + s.num_query_tokens)
            scores = torch.einsum("qhd,khd->hqk", q[rows], keys) * scale  # [H, n, L]
            q_pos = torch.arange(s.start_pos, s.seq_len, device=device)[:, None]
            k_pos = torch.arange(s.seq_len, device=device)[None, :]
            allowed = _visible(q_pos, k_pos, meta.sliding_window, meta.num_sink_tokens)
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[rows] = torch.einsum("hqk,khd->qhd", probs, values)
        return out


def _write_tokens(
    kv_cache: LayerCache,
    blk: torch.Tensor,  # [n] long
    off: torch.Tensor,  # [n] long
    k: torch.Tensor,  # [n, kvh, d]
    v: torch.Tensor,  # [n, kvh, d]
) -> None:
    """Reference write: token i goes to block ``blk[i]`` offset ``off[i]`` (quantized if so)."""
    if isinstance(kv_cache, QuantizedLayerCache):
        for i, x in ((0, k), (1, v)):
            data, scales = quantize_kv(x, kv_cache.kind)
            kv_cache.data[i, blk, off] = data
            kv_cache.scales[i, blk, off] = scales
        return
    kv_cache[0, blk, off] = k
    kv_cache[1, blk, off] = v


def _read_tokens(
    kv_cache: LayerCache, blk: torch.Tensor, off: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference read of K and V ``[n, kvh, d]`` at (block, offset) pairs, dequantized."""
    if isinstance(kv_cache, QuantizedLayerCache):
        kind = kv_cache.kind
        data, scales = kv_cache.data, kv_cache.scales
        return (
            dequantize_kv(data[0, blk, off], scales[0, blk, off], kind, dtype),
            dequantize_kv(data[1, blk, off], scales[1, blk, off], kind, dtype),
        )
    return kv_cache[0, blk, off], kv_cache[1, blk, off]


def _write_slots(
    kv_cache: LayerCache,
    slot_mapping: torch.Tensor,  # [T] long
    k: torch.Tensor,  # [T, kvh, d]
    v: torch.Tensor,  # [T, kvh, d]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fast write of all new K/V through the slot mapping.

    Returns K and V as later reads will see them (dequantized for a quantized cache).
    """
    _, num_blocks, bs, num_kv_heads, head_dim = kv_cache.shape
    if not isinstance(kv_cache, QuantizedLayerCache):
        flat = kv_cache.view(2, num_blocks * bs, num_kv_heads, head_dim)
        flat[0].index_copy_(0, slot_mapping, k)
        flat[1].index_copy_(0, slot_mapping, v)
        return k, v
    flat = kv_cache.data.view(2, num_blocks * bs, num_kv_heads, head_dim)
    flat_scales = kv_cache.scales.view(2, num_blocks * bs, num_kv_heads)
    read_back = []
    for i, x in ((0, k), (1, v)):
        data, scales = quantize_kv(x, kv_cache.kind)  # [T, kvh, d], [T, kvh]
        flat[i].index_copy_(0, slot_mapping, data)
        flat_scales[i].index_copy_(0, slot_mapping, scales)
        read_back.append(dequantize_kv(data, scales, kv_cache.kind, x.dtype))
    return read_back[0], read_back[1]


def _gather_rows(
    block_ids: torch.Tensor, num_blocks: int, memo: dict[int, torch.Tensor]
) -> torch.Tensor:  # [2 * len(block_ids)] long
    """Rows of K blocks then V blocks in a layer cache viewed as ``[2 * num_blocks, ...]``.

    Made once per step (all layers share ``num_blocks``) and kept in ``memo``.
    """
    rows = memo.get(num_blocks)
    if rows is None:
        rows = block_ids.repeat(2)
        rows[block_ids.shape[0] :].add_(num_blocks)
        memo[num_blocks] = rows
    return rows


def _gather_blocks(
    kv_cache: LayerCache, rows: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:  # [2, len(rows) // 2 * block_size, kvh, d]
    """Fast read of whole blocks (K and V) at ``rows`` (from ``_gather_rows``), dequantized."""
    _, num_blocks, _, num_kv_heads, head_dim = kv_cache.shape
    # NOTE: gather whole blocks as rows of the 2-D view [2 * num_blocks, block numel]: one
    # contiguous copy per block (~2x faster than index_select on the 5-D cache), on dim 0,
    # which index_select splits across threads; on dim 1 of a [2, num_blocks, -1] view it
    # runs on one (2 threads, B=32, ctx 192, 30 layers: 28 vs 57-78 ms; equal on 1 thread).
    if not isinstance(kv_cache, QuantizedLayerCache):
        kv = kv_cache.view(2 * num_blocks, -1).index_select(0, rows)
        return kv.view(2, -1, num_kv_heads, head_dim)
    data = kv_cache.data.view(2 * num_blocks, -1).index_select(0, rows)
    scales = kv_cache.scales.view(2 * num_blocks, -1).index_select(0, rows)
    return dequantize_kv(
        data.view(2, -1, num_kv_heads, head_dim),
        scales.view(2, -1, num_kv_heads),
        kv_cache.kind,
        dtype,
    )


class TorchSDPABackend(AttentionBackend):
    """Fast path: one batched SDPA call for all decodes, one SDPA call per prefill chunk."""

    name = "torch_sdpa"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerCache,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k, v = _write_slots(kv_cache, meta.slot_mapping, k, v)
        nd = meta.num_decode_seqs
        if nd == meta.num_tokens:
            return self._decode(q, kv_cache, meta)
        out = torch.empty_like(q) if out is None else out
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta)
        for c in meta.chunks:
            rows = slice(c.token_offset, c.token_offset + c.num_query_tokens)
            out[rows] = self._chunk(q[rows], k[rows], v[rows], kv_cache, c)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: LayerCache, meta: AttentionMetadata) -> torch.Tensor:
        # q: [B, H, d]; every query is the last position of its sequence.
        groups = meta.decode_groups
        if len(groups) == 1:
            return TorchSDPABackend._decode_group(q, kv_cache, groups[0], meta.block_size)
        out = torch.empty_like(q)
        for g in groups:
            rows = slice(g.row_start, g.row_end)
            out[rows] = TorchSDPABackend._decode_group(q[rows], kv_cache, g, meta.block_size)
        return out

    @staticmethod
    def _decode_group(
        q: torch.Tensor,  # [B_g, H, d]
        kv_cache: LayerCache,
        g: DecodeGroup,
        block_size: int,
    ) -> torch.Tensor:  # [B_g, H, d]
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[3]
        max_len = g.max_blocks * block_size
        rows = _gather_rows(g.block_ids, kv_cache.shape[1], g.gather_rows)
        kv = _gather_blocks(kv_cache, rows, q.dtype)
        kv = kv.view(2, num_seqs, max_len, num_kv_heads, head_dim).transpose(2, 3)  # [2,B,kvh,L,d]
        # NOTE: GQA without copying K/V: the query heads of one KV head share its keys and the
        # same mask, so they ride in SDPA's query-length axis: [B, kvh, group, d].
        qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=g.mask)
        return o.reshape(num_seqs, num_heads, head_dim)

    @staticmethod
    def _chunk(
        q: torch.Tensor,  # [n, H, d]
        k: torch.Tensor,  # [n, kvh, d]
        v: torch.Tensor,  # [n, kvh, d]
        kv_cache: LayerCache,
        c: ChunkMeta,
        compute_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """SDPA of one chunk; with ``compute_dtype`` (e.g. float32 for a bf16 model) the
        inputs are converted to it and the output back to ``q``'s dtype."""
        if c.ctx_block_ids is None:
            keys, values = k, v  # the chunk is the whole context so far
        else:
            rows = _gather_rows(c.ctx_block_ids, kv_cache.shape[1], c.gather_rows)
            kv = _gather_blocks(kv_cache, rows, q.dtype)  # [2, ctx_len, kvh, d]
            keys, values = kv[0], kv[1]  # [ctx_len, kvh, d]
        mask = c.mask
        dtype = q.dtype
        if compute_dtype is not None and compute_dtype != dtype:
            q, keys, values = q.to(compute_dtype), keys.to(compute_dtype), values.to(compute_dtype)
            mask = mask.to(compute_dtype) if mask is not None else None
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, n, d]
            keys.transpose(0, 1).unsqueeze(0),  # [1, kvh, L, d]
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1).to(dtype)  # [n, H, d]


_BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchReferenceBackend.name: TorchReferenceBackend,
    TorchSDPABackend.name: TorchSDPABackend,
}


def get_attention_backend(name: str = "auto") -> AttentionBackend:
    """Instantiate an attention backend by name.

    'torch_sdpa', 'torch_ref', 'native' (the C++ CPU kernels, see ``kvserve.runtime.native``;
    ValueError if they cannot be built) or 'auto': 'native' where the kernels load, else
    'torch_sdpa'.
    """
    if name in ("native", "auto"):
        from kvserve.runtime import native
        from kvserve.runtime.native.backend import NativeCPUBackend

        if native.available():
            return NativeCPUBackend()
        if name == "native":
            raise ValueError(f"attention backend 'native' is unavailable: {native.reason()}")
        return TorchSDPABackend()
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of "
            f"{sorted([*_BACKENDS, 'native', 'auto'])}"
        ) from None
