"""Decode steps as CUDA graphs: persistent inputs padded to a batch-size bucket, one capture
per bucket, replayed (the Triton attention backend only; ``--enforce-eager`` turns it off).

``DecodeGraphInputs`` holds the step's inputs in persistent buffers sized for the largest
bucket: token ids, positions, slots, and the Triton plan (block tables ``[rows,
max_blocks]``, context lengths ``[rows]``; the query starts and tiles of a decode step are fixed:
row i is sequence i). ``fill`` copies a pure-decode step into them with one host-to-device
copy, padding rows ``B..bucket-1`` as sequences of one token at position 0 whose K/V write
is skipped (slot -1) and whose output is never read. ``meta(bucket)`` is the step metadata
every captured layer reads (its views never move). All of this runs on any device: the CPU
tests run a padded step eagerly (kernels under ``TRITON_INTERPRET=1``) against the unpadded
one. ``DecodeGraphs`` captures and replays (CUDA only; ``tests/cuda``).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch

from kvserve.runtime.attention.metadata import AttentionMetadata, SeqSpec
from kvserve.runtime.attention.triton.plan import (
    DECODE_BLOCK_M,
    TritonStepPlan,
    choose_num_splits,
)
from kvserve.runtime.input_batch import InputBatch
from kvserve.runtime.workspace import Workspace

logger = logging.getLogger("kvserve")

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: the buckets up to ``max_num_seqs``, and it."""
    sizes = [b for b in GRAPH_BUCKETS if b < max_num_seqs]
    return [*sizes, max_num_seqs]


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``num_seqs`` rows (None: larger than every bucket)."""
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) else None


def is_pure_decode(batch: InputBatch) -> bool:
    """Whether every row of the step is a decode that samples (what a graph replays)."""
    meta = batch.attn_meta
    return meta.num_decode_seqs == meta.num_tokens == len(batch.sample_requests) > 0


class DecodeGraphInputs:
    """Persistent, padded inputs of pure-decode steps (see module docstring)."""

    def __init__(
        self,
        *,
        max_rows: int,
        max_blocks: int,
        block_size: int,
        num_heads: int,
        num_kv_heads: int,
        max_model_len: int,
        device: torch.device,
        sliding_window: int | None = None,
        num_sink_tokens: int = 0,
    ) -> None:
        self.max_rows, self.max_blocks, self.block_size = max_rows, max_blocks, block_size
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.max_model_len = max_model_len
        self.sliding_window, self.num_sink_tokens = sliding_window, num_sink_tokens
        self.group = num_heads // num_kv_heads
        self.input_ids = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.slots = torch.full((max_rows,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        rows = torch.arange(max_rows + 1, dtype=torch.int32, device=device)
        self.query_start = rows  # row i is sequence i; then T
        self.tiles = rows[:-1]
        self._metas: dict[int, AttentionMetadata] = {}

    def meta(self, bucket: int) -> AttentionMetadata:
        """The metadata of a ``bucket``-row step over the persistent buffers (made once)."""
        meta = self._metas.get(bucket)
        if meta is None:
            # NOTE: host-side seqs only size the RoPE table lookup (positions < max_model_len)
            # and the row count; the kernels read the buffers.
            seqs = [SeqSpec(i, 1, self.max_model_len - 1, []) for i in range(bucket)]
            meta = AttentionMetadata(
                block_size=self.block_size,
                seqs=seqs,
                num_tokens=bucket,
                slot_mapping=self.slots[:bucket],
                sliding_window=self.sliding_window,
                num_sink_tokens=self.num_sink_tokens,
                num_decode_seqs=bucket,
            )
            block_m = max(DECODE_BLOCK_M, 1 << max(0, self.group - 1).bit_length())
            meta.backend_plans["triton"] = TritonStepPlan(
                block_table=self.tables[:bucket],
                seq_lens=self.seq_lens[:bucket],
                query_start=self.query_start[: bucket + 1],
                tile_seq=self.tiles[:bucket],
                tile_start=self.tiles[:bucket],
                block_m=block_m,
                block_q=block_m // self.group,
                num_splits=choose_num_splits(bucket * self.num_kv_heads, self.max_model_len),
            )
            self._metas[bucket] = meta
        return meta

    def fill(self, batch: InputBatch, bucket: int) -> None:
        """Copy ``batch`` (pure decode, ``B <= bucket`` rows) into the buffers, padded."""
        meta = batch.attn_meta
        num = meta.num_tokens
        if num > bucket or bucket > self.max_rows:
            raise ValueError(f"{num} rows do not fit bucket {bucket} (max {self.max_rows})")
        # NOTE: only the step's widest table is copied: a row's kernel reads no column past
        # its own length, and a padding row (length 1) reads column 0, which is zeroed.
        bs = self.block_size
        width = min(self.max_blocks, max(-(-s.seq_len // bs) for s in meta.seqs))
        rows: list[int] = []
        lens: list[int] = []
        for s in meta.seqs:
            ids = s.block_ids[:width]
            rows.extend([*ids, *([0] * (width - len(ids)))])
            lens.append(s.seq_len)
        rows.extend([0] * (width * (bucket - num)))
        lens.extend([1] * (bucket - num))
        host = torch.tensor(rows + lens, dtype=torch.int32)  # one host tensor, two copies
        self.tables[:bucket, :width].copy_(host[: bucket * width].view(bucket, width))
        self.seq_lens[:bucket].copy_(host[bucket * width :])
        self.input_ids[:num].copy_(batch.input_ids)
        self.positions[:num].copy_(batch.positions)
        self.slots[:num].copy_(meta.slot_mapping)
        self.input_ids[num:bucket].zero_()
        self.positions[num:bucket].zero_()
        self.slots[num:bucket].fill_(-1)


class DecodeGraphs:
    """One CUDA graph per bucket over ``DecodeGraphInputs`` (CUDA only)."""

    def __init__(self, inputs: DecodeGraphInputs, buckets: list[int]) -> None:
        self.inputs = inputs
        self.buckets = buckets
        # NOTE: the captured steps' own activation buffers: an eager step that grew a shared
        # workspace would free memory a graph still replays into.
        self.workspace = Workspace()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool_bytes = 0

    def capture(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, Workspace], torch.Tensor],
    ) -> None:
        """Capture ``forward(input_ids, positions, meta, workspace) -> hidden`` for every
        bucket, the largest first (the smaller ones reuse its buffers and memory pool)."""
        before = torch.cuda.memory_reserved()
        pool = None
        for bucket in sorted(self.buckets, reverse=True):
            ids, pos = self.inputs.input_ids[:bucket], self.inputs.positions[:bucket]
            meta = self.inputs.meta(bucket)
            forward(
                ids, pos, meta, self.workspace
            )  # warm: kernels compiled, buffers grown, outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward(ids, pos, meta, self.workspace)
            pool = graph.pool()
            self.graphs[bucket] = (graph, out)
        torch.cuda.synchronize()
        self.pool_bytes = torch.cuda.memory_reserved() - before
        logger.debug(
            "CUDA graphs: %d decode buckets up to %d rows, %.1f MiB",
            len(self.graphs),
            max(self.buckets),
            self.pool_bytes / (1 << 20),
        )

    def run(self, batch: InputBatch) -> torch.Tensor | None:
        """Replay the bucket of a pure-decode ``batch``: its hidden rows ``[B, hidden]`` (a
        view of the graph's output, valid until the next replay), or None (no bucket)."""
        bucket = bucket_for(batch.attn_meta.num_tokens, self.buckets)
        if bucket is None or bucket not in self.graphs:
            return None
        self.inputs.fill(batch, bucket)
        graph, out = self.graphs[bucket]
        graph.replay()
        return out[: batch.attn_meta.num_tokens]
