"""Host side of the Triton attention: one step's launch plan, built once and shared by layers.

``build_step_plan`` turns the step's ``AttentionMetadata`` into the few int32 arrays the
kernel reads: the block tables ``[S, W]``, the context lengths ``[S]``, the query row starts
``[S + 1]`` and, per query tile, its sequence and first row. They are packed into one host
tensor and copied to the device in one transfer (then sliced), so a step's attention inputs
cost one copy whatever the batch. Query tiles: each sequence's rows are cut into tiles of
``block_q`` rows (a decode is one tile); every tile runs for every KV head, and for
``num_splits`` slices of its keys when the step has too few tiles to fill the device
(split-K, merged by ``split_reduce``).

Nothing here imports triton: the plan is plain torch and is tested without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.runtime.attention.metadata import AttentionMetadata

# Keys one program of the kernel scores per loop iteration.
TILE_N = 32
# Query rows x heads one program holds: the minimum of ``tl.dot``'s M for a decode step; a
# step with multi-row chunks uses CHUNK_BLOCK_M (more rows share each loaded key tile).
DECODE_BLOCK_M = 16
CHUNK_BLOCK_M = 64
# Split-K: only where (tiles x KV heads) is below this many programs, each split gets at
# least SPLIT_MIN_TOKENS keys, and at most MAX_SPLITS splits.
TARGET_PROGRAMS = 512
SPLIT_MIN_TOKENS = 256
MAX_SPLITS = 16


@dataclass(slots=True)
class TritonStepPlan:
    """What the Triton kernels read for one step (device tensors are views of one buffer)."""

    block_table: torch.Tensor  # [S, W] int32, NULL_BLOCK_ID (-1) kept: the kernel reads 0
    seq_lens: torch.Tensor  # [S] int32 context length after the step
    query_start: torch.Tensor  # [S + 1] int32 first flat row of each sequence, then T
    tile_seq: torch.Tensor  # [P] int32 sequence of each query tile
    tile_start: torch.Tensor  # [P] int32 first flat row of each query tile
    block_m: int  # query rows x heads per program (a power of two >= 16)
    block_q: int  # query rows per tile (block_m // GQA group)
    num_splits: int  # key slices per tile (1: no split-K)
    tile_n: int = TILE_N

    @property
    def num_tiles(self) -> int:
        """Query tiles of the step (the kernel's first grid dimension)."""
        return self.tile_seq.shape[0]


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def choose_num_splits(num_programs: int, max_seq_len: int) -> int:
    """Key slices per tile: enough programs to fill the device, each slice long enough."""
    if num_programs >= TARGET_PROGRAMS or max_seq_len < 2 * SPLIT_MIN_TOKENS:
        return 1
    by_len = max_seq_len // SPLIT_MIN_TOKENS
    by_programs = -(-TARGET_PROGRAMS // max(num_programs, 1))
    return max(1, min(MAX_SPLITS, by_len, by_programs))


def build_step_plan(
    meta: AttentionMetadata,
    num_heads: int,
    num_kv_heads: int,
    device: torch.device,
    *,
    num_splits: int | None = None,
    block_m: int | None = None,
) -> TritonStepPlan:
    """The launch plan of ``meta``'s step for a model with these heads.

    ``num_splits`` / ``block_m``: fixed values instead of the heuristics (tests use them to
    reach split-K and multi-tile chunks at small sizes).
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    seqs = meta.seqs
    bs = meta.block_size
    max_q = max((s.num_query_tokens for s in seqs), default=1)
    if block_m is None:
        block_m = DECODE_BLOCK_M if max_q == 1 else CHUNK_BLOCK_M
    block_m = max(block_m, _next_pow2(group), 16)
    if block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    block_q = block_m // group
    width = max((-(-s.seq_len // bs) for s in seqs), default=0)
    width = max(width, 1)
    table: list[int] = []
    lens: list[int] = []
    starts: list[int] = []
    tile_seq: list[int] = []
    tile_start: list[int] = []
    for i, s in enumerate(seqs):
        row = s.block_ids[:width]
        table.extend(row)
        table.extend([0] * (width - len(row)))
        lens.append(s.seq_len)
        starts.append(s.token_offset)
        for r in range(s.token_offset, s.token_offset + s.num_query_tokens, block_q):
            tile_seq.append(i)
            tile_start.append(r)
    starts.append(meta.num_tokens)
    if num_splits is None:
        max_len = max(lens, default=0)
        num_splits = choose_num_splits(len(tile_seq) * num_kv_heads, max_len)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    # NOTE: one host buffer, one copy to the device; every array is a view of it.
    packed = torch.tensor(table + lens + starts + tile_seq + tile_start, dtype=torch.int32)
    packed = packed.to(device, non_blocking=True) if device.type != "cpu" else packed
    n_seq, n_tab, n_tile = len(seqs), len(table), len(tile_seq)
    views = torch.split(packed, [n_tab, n_seq, n_seq + 1, n_tile, n_tile])
    return TritonStepPlan(
        block_table=views[0].view(n_seq, width),
        seq_lens=views[1],
        query_start=views[2],
        tile_seq=views[3],
        tile_start=views[4],
        block_m=block_m,
        block_q=block_q,
        num_splits=num_splits,
    )
