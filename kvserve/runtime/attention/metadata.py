"""Step metadata for paged attention: what every layer of a step shares.

``build_attention_metadata`` turns the step's sequences (``SeqSpec``: where each sits in the
flat batch, its start position and block table) into the slot mapping of the new tokens and
the chunks' gather indices and masks, once per step. The decodes' per-backend views (the SDPA
decode groups, the native kernel's block tables) are made by ``AttentionMetadata`` on first
use. ``plan_decode_groups`` splits the decodes into runs that each pad to their longest.

Windowed attention with sinks and the ``NULL_BLOCK_ID`` entries of freed blocks: see the
package docstring (``kvserve.runtime.attention``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

NULL_BLOCK_ID = -1  # a block-table entry whose block was freed (out of the window)


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
    # Row ids of ``ctx_block_ids`` for the gather, by cache size (see ``sdpa._gather_rows``).
    gather_rows: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class DecodeGroup:
    """Fast-path data for a run of decode rows ``[row_start, row_end)`` batched together."""

    row_start: int
    row_end: int
    block_ids: torch.Tensor  # [num_seqs * max_blocks] long, padded with block 0
    max_blocks: int  # the longest sequence of the group, in blocks
    mask: torch.Tensor  # [num_seqs, 1, 1, max_blocks * block_size] additive (0 / -inf)
    # Row ids of ``block_ids`` for the gather, by cache size (see ``sdpa._gather_rows``).
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
    # The factor of q . k (None: head_dim ** -0.5) and the soft cap of the scores
    # (``cap * tanh(s / cap)``, Gemma 2; None: none); set per layer kind by the model.
    scale: float | None = None
    logit_softcap: float | None = None
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
    # Hybrid KV cache: layer i reads ``layer_metas[i]``, its KV cache group's metadata (its
    # block tables and window); None: every layer reads this one.
    layer_metas: list[AttentionMetadata] | None = None

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


def readable_table(block_ids: list[int]) -> list[int]:
    """The block table with freed entries read as block 0 (masked out by the caller)."""
    return [0 if b == NULL_BLOCK_ID else b for b in block_ids]


def visible_mask(
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
        readable_table(s.block_ids[:max_blocks]) + [0] * (max_blocks - len(s.block_ids))
        for s in dec
    ]
    seq_lens = torch.tensor([s.seq_len for s in dec], dtype=torch.long, device=device)
    key_pos = torch.arange(max_blocks * block_size, device=device)  # [L]
    valid = visible_mask(seq_lens[:, None] - 1, key_pos[None, :], sliding_window, num_sink_tokens)
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
                readable_table(s.block_ids[:num_ctx_blocks]), dtype=torch.long, device=device
            )
        if start > 0 or needs_window:
            ctx_len = end if start == 0 else -(-end // block_size) * block_size
            q_pos = torch.arange(start, end, device=device)[:, None]  # [n, 1]
            k_pos = torch.arange(ctx_len, device=device)[None, :]  # [1, ctx_len]
            valid = visible_mask(q_pos, k_pos, sliding_window, sinks)
            mask = torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill_(
                ~valid, neg_inf
            )
        meta.chunks.append(ChunkMeta(s.token_offset, n, start, ctx_block_ids, end, mask))
    return meta
