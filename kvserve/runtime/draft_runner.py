"""The draft model of speculative decoding: its KV beside the target's, its proposals.

The draft model's KV shares the target's block ids: a block id names the same tokens in the
target's KV tensors and in the draft's (``kv_cache``, one ``KVCache`` of the draft's shape,
the same number of device and host blocks). A token's draft KV is a function of the token
prefix, as its target KV is, so everything the KV cache manager does with a block id
(prefix-cache hits, copy-on-write, forks, swap, ``release_rejected``) stays right for both,
with one allocator; the runner applies every block copy to both caches (``copy_blocks``,
``swap_out``, ``swap_in``). Each block's bytes are the target's plus the draft's, so the memory
plan, admission and capacity figures count the draft (``engine/draft_model.py``).

Each step (``ModelRunner.execute``):

1. ``propose``: the draft runs over the step's scheduled tokens (prefill chunks, decode
   tokens: its KV follows the target's), except the drafts still to be chosen
   (``DRAFT_PLACEHOLDER_TOKEN_ID``, ``core/sched/speculate.py``); for each request with ``k``
   placeholders it takes the argmax at its last known token, then runs ``k - 1`` one-token
   steps over its own drafts (their KV goes into the lookahead slots the scheduler
   allocated). The placeholders become those ``k`` drafts.
2. The target verifies them (``runtime/spec_verify.py``).
3. ``catch_up``: a request whose ``k`` drafts were all accepted has the last one verified
   but not yet run by the draft model: one more draft step writes its KV, so the draft's KV
   covers every verified token before any block of it can reach the prefix cache.

Drafts are the draft model's argmax (greedy, a one-hot ``q``), which keeps verification
exact at any temperature (``spec_verify``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kvserve.config import ModelArchConfig
from kvserve.core.outputs import DRAFT_PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from kvserve.runtime.input_batch import build_input_batch
from kvserve.runtime.kv_cache import KVCache
from kvserve.runtime.sampler.greedy import argmax
from kvserve.runtime.workspace import Workspace


def num_placeholders(r: ScheduledRequest) -> int:
    """How many of ``r``'s drafts the draft model is to choose (0: none, or n-gram drafts)."""
    drafts = r.spec_token_ids
    return len(drafts) if drafts and drafts[0] == DRAFT_PLACEHOLDER_TOKEN_ID else 0


class DraftRunner:
    """The draft model, its KV cache over the target's block ids, its workspace."""

    def __init__(
        self,
        model: nn.Module,
        arch: ModelArchConfig,
        *,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model = model.to(device=device, dtype=dtype)
        self.arch = arch
        self.device, self.dtype = device, dtype
        self.block_size, self.num_blocks = block_size, num_blocks
        self.kv_cache = KVCache(
            num_layers=arch.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
            num_host_blocks=num_host_blocks,
            device=device,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
        )
        self.workspace = Workspace()

    def _forward(self, scheduled: list[ScheduledRequest]) -> dict[str, int]:
        """One draft forward over ``scheduled``; the argmax of each sampling request."""
        batch = build_input_batch(
            SchedulerOutput(scheduled=scheduled),
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            device=self.device,
            dtype=self.dtype,
            sliding_window=self.arch.shared_window,
        )
        hidden = self.model(
            batch.input_ids,
            batch.positions,
            self.kv_cache.layer_caches,
            batch.attn_meta,
            self.workspace,
        )  # [T, hidden]
        if not batch.sample_requests:
            return {}
        logits = self.model.compute_logits(
            hidden.index_select(0, batch.logits_indices), keep_dtype=True
        )  # [N, vocab]
        ids = argmax(logits).tolist()
        return {r.request_id: t for r, t in zip(batch.sample_requests, ids, strict=True)}

    def propose(self, scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """Run the draft over the step (module docstring, 1); returns ``scheduled`` with each
        request's placeholders replaced by the draft model's tokens."""
        known = []
        for r in scheduled:
            k = num_placeholders(r)
            known.append(
                dataclasses.replace(
                    r,
                    token_ids=r.token_ids[: len(r.token_ids) - k],
                    sample=k > 0,
                    spec_token_ids=[],
                )
            )
        drafts: dict[str, list[int]] = {rid: [t] for rid, t in self._forward(known).items()}
        want = {r.request_id: num_placeholders(r) for r in scheduled}
        base = {r.request_id: r for r in known}
        for j in range(1, max(want.values(), default=0)):
            step = [
                _one_token(base[rid], d[-1], j, sample=True)
                for rid, d in drafts.items()
                if want[rid] > j
            ]
            for rid, t in self._forward(step).items():
                drafts[rid].append(t)
        out = []
        for r in scheduled:
            d = drafts.get(r.request_id)
            if d is None or not want[r.request_id]:
                out.append(r)
                continue
            n = len(r.token_ids) - len(d)
            out.append(dataclasses.replace(r, token_ids=r.token_ids[:n] + d, spec_token_ids=d))
        return out

    def catch_up(self, spec_requests: list[ScheduledRequest], accepted: dict[str, int]) -> None:
        """Module docstring, 3: the draft's KV of a last draft the target accepted."""
        step = [
            _one_token(r, r.spec_token_ids[-1], len(r.spec_token_ids), sample=False)
            for r in spec_requests
            if num_placeholders(r) == 0
            and r.spec_token_ids
            and accepted.get(r.request_id) == len(r.spec_token_ids)
        ]
        if step:
            self._forward(step)


def _one_token(r: ScheduledRequest, token: int, offset: int, *, sample: bool) -> ScheduledRequest:
    """``r``'s ``offset``-th token past its known ones (``r.token_ids`` minus drafts), alone."""
    known = len(r.token_ids) - len(r.spec_token_ids)
    return dataclasses.replace(
        r,
        token_ids=[token],
        start_pos=r.start_pos + known + offset - 1,
        sample=sample,
        spec_token_ids=[],
    )
