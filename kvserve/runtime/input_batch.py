"""SchedulerOutput -> flat (ragged) batch tensors for one forward pass.

The scheduled tokens of all requests are concatenated into one batch of ``T`` tokens.
NOTE: requests with exactly one new token (decodes) are placed first, shortest context
first, so the attention fast path runs them as a few batched calls over consecutive rows
(``plan_decode_groups``: sequences of similar length pad to each other, not to the longest
of the step). The order is internal: results go back by request id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvserve.core.kv.kv_groups import KVGroupSpec
from kvserve.core.outputs import ScheduledRequest, SchedulerOutput
from kvserve.runtime.attention.metadata import AttentionMetadata, SeqSpec, build_attention_metadata
from kvserve.runtime.spec_verify import spec_rows


@dataclass(slots=True)
class InputBatch:
    """The tensors of one step, in flat-batch order."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    attn_meta: AttentionMetadata
    requests: list[ScheduledRequest]  # flat-batch order
    logits_indices: torch.Tensor  # [N] long: rows of the hidden states that sample
    sample_requests: list[ScheduledRequest]  # row i of the logits belongs to sample_requests[i]
    # Speculative decoding: the requests with drafts; each has k + 1 rows in sample_requests
    # (``spec_verify.spec_rows``), folded back into one result by ``fold_verified``.
    spec_requests: list[ScheduledRequest] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def _batch_order(r: ScheduledRequest) -> tuple[bool, int]:
    """Sort key: decodes first, by context length; other requests keep their order (stable)."""
    is_decode = len(r.token_ids) == 1
    return (not is_decode, r.start_pos if is_decode else 0)


def build_input_batch(
    sched: SchedulerOutput,
    *,
    block_size: int,
    num_blocks: int,
    device: torch.device,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    num_sink_tokens: int = 0,
    kv_groups: Sequence[KVGroupSpec] | None = None,
) -> InputBatch:
    """Flatten ``sched.scheduled`` into one batch (decodes first); validates block tables.

    With ``kv_groups`` (a hybrid KV cache), one metadata per group from each request's
    ``group_block_ids`` and the group's window; ``attn_meta.layer_metas`` gives each layer
    its group's (``sliding_window`` is then unused).
    """
    reqs = sorted(sched.scheduled, key=_batch_order)
    input_ids: list[int] = []
    positions: list[int] = []
    seqs: list[SeqSpec] = []
    logits_rows: list[int] = []
    sample_requests: list[ScheduledRequest] = []
    spec_requests: list[ScheduledRequest] = []
    for r in reqs:
        n = len(r.token_ids)
        if n == 0:
            raise ValueError(f"request {r.request_id!r}: scheduled with no tokens")
        if r.start_pos < 0:
            raise ValueError(f"request {r.request_id!r}: negative start_pos {r.start_pos}")
        end = r.start_pos + n
        _check_table(r, r.block_ids, end, block_size, num_blocks)
        offset = len(input_ids)
        seqs.append(SeqSpec(offset, n, r.start_pos, r.block_ids))
        input_ids.extend(r.token_ids)
        positions.extend(range(r.start_pos, end))
        if r.sample and r.spec_token_ids:
            k = len(r.spec_token_ids)
            logits_rows.extend(range(offset + n - 1 - k, offset + n))
            sample_requests.extend(spec_rows(r))
            spec_requests.append(r)
        elif r.sample:
            logits_rows.append(offset + n - 1)
            sample_requests.append(r)
    if kv_groups is not None:
        meta = _group_metadata(reqs, seqs, kv_groups, block_size, num_blocks, device, dtype)
    else:
        meta = build_attention_metadata(
            seqs,
            block_size=block_size,
            device=device,
            dtype=dtype,
            sliding_window=sliding_window,
            num_sink_tokens=num_sink_tokens,
        )
    # NOTE: one host->tensor conversion (one allocation) for all three index vectors; the
    # fields are views of it.
    num_tokens = len(input_ids)
    flat = torch.tensor(input_ids + positions + logits_rows, dtype=torch.long, device=device)
    return InputBatch(
        input_ids=flat[:num_tokens],
        positions=flat[num_tokens : 2 * num_tokens],
        attn_meta=meta,
        requests=reqs,
        logits_indices=flat[2 * num_tokens :],
        sample_requests=sample_requests,
        spec_requests=spec_requests,
    )


def _check_table(
    r: ScheduledRequest, block_ids: list[int], end: int, block_size: int, num_blocks: int
) -> None:
    """ValueError unless ``block_ids`` covers ``end`` tokens with ids of the pool."""
    if len(block_ids) * block_size < end:
        raise ValueError(
            f"request {r.request_id!r}: block table of {len(block_ids)} blocks cannot hold "
            f"{end} tokens (block_size {block_size})"
        )
    # NOTE: -1 (NULL_BLOCK_ID) marks a block freed out of the KV window.
    if block_ids and (min(block_ids) < -1 or max(block_ids) >= num_blocks):
        raise ValueError(
            f"request {r.request_id!r}: block id out of range [0, {num_blocks}): {block_ids}"
        )


def _group_metadata(
    reqs: list[ScheduledRequest],
    seqs: list[SeqSpec],
    kv_groups: Sequence[KVGroupSpec],
    block_size: int,
    num_blocks: int,
    device: torch.device,
    dtype: torch.dtype,
) -> AttentionMetadata:
    """One metadata per KV cache group (its tables, its window); group 0's carries them all
    as ``layer_metas``, one per layer."""
    metas = []
    for g, spec in enumerate(kv_groups):
        group_seqs = []
        for r, s in zip(reqs, seqs, strict=True):
            if r.group_block_ids is None or len(r.group_block_ids) != len(kv_groups):
                raise ValueError(
                    f"request {r.request_id!r}: needs a block table per KV cache group "
                    f"({len(kv_groups)})"
                )
            table = r.group_block_ids[g]
            _check_table(r, table, s.start_pos + s.num_query_tokens, block_size, num_blocks)
            group_seqs.append(SeqSpec(s.token_offset, s.num_query_tokens, s.start_pos, table))
        metas.append(
            build_attention_metadata(
                group_seqs,
                block_size=block_size,
                device=device,
                dtype=dtype,
                sliding_window=spec.window,
            )
        )
    num_layers = sum(len(spec.layers) for spec in kv_groups)
    layer_metas: list[AttentionMetadata] = [metas[0]] * num_layers
    for g, spec in enumerate(kv_groups):
        for layer in spec.layers:
            layer_metas[layer] = metas[g]
    metas[0].layer_metas = layer_metas
    return metas[0]
