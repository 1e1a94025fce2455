"""Per-request guards around sampling: one request's bad numbers never reach another's.

The sampler works on a batch of rows, one per request that samples this step. A row can go
wrong on its own: the model produced NaN / inf logits for it, or its sampling work raised,
or the id it drew lies outside the vocabulary (what a NaN row's inverse-CDF draw yields).
``sample_guarded`` finds such rows, leaves them out of the result and names them with a
reason, so the engine fails those requests and serves the rest of the batch as usual.
"""

from __future__ import annotations

import logging
import math

import torch

from kvserve.core.outputs import GrammarBitmask, LogprobsEntry, ScheduledRequest
from kvserve.runtime.logits_constraints import RowBitmask, match_bitmask_rows
from kvserve.runtime.sampler import Sampler

logger = logging.getLogger("kvserve.guard")


def nonfinite_rows(logits: torch.Tensor, vocab_size: int) -> list[int]:
    """Rows of ``logits`` [N, V] holding a NaN or an infinity among the first ``vocab_size``.

    NOTE: a sum is finite exactly when every entry is (NaN and inf propagate; finite float32
    logits cannot overflow at realistic magnitudes). The common case costs one reduction over
    the whole batch and one scalar (one new storage per step: see test_hotpath); rows are
    looked at only when that sum is not finite.
    """
    real = logits[:, :vocab_size]  # [N, V]
    if math.isfinite(real.sum().item()):
        return []
    bad = ~torch.isfinite(real.float().sum(dim=-1))  # [N]
    return bad.nonzero().flatten().tolist()


def sample_guarded(
    sampler: Sampler,
    logits: torch.Tensor,
    reqs: list[ScheduledRequest],
    grammar: GrammarBitmask | None = None,
) -> tuple[dict[str, int], dict[str, LogprobsEntry], dict[str, str]]:
    """Sample every row of ``logits`` [N, V]; rows that fail are reported, not raised.

    ``grammar``: the step's structured-output bitmask (rows matched to requests by id).

    Returns (sampled id per request, logprobs entry per request that asked, failure reason
    per request that failed). A batch that raises is sampled again row by row, so only the
    rows that raise alone fail.
    """
    vocab = sampler.vocab_size
    failed: dict[str, str] = {}
    token_ids: dict[str, int] = {}
    logprobs: dict[str, LogprobsEntry] = {}
    bitmask = match_bitmask_rows(grammar, reqs)
    try:
        # NOTE: the common all-greedy batch: the argmax finds the non-finite rows in its own
        # pass over the logits (one cold read of them instead of two).
        greedy = sampler.sample_greedy_checked(logits, reqs, bitmask)
    except Exception as e:  # noqa: BLE001 - the general path below checks and isolates
        # NOTE: the exception is named: a fast path that raises on every step (a sampler
        # without the method, as tensor-parallel workers had) must not pass for a bad row.
        logger.warning(
            "the greedy fast path raised %r on %d rows; sampling them in turn", e, len(reqs)
        )
        greedy = None
    bad = set(greedy[2] if greedy is not None else nonfinite_rows(logits, vocab))
    rows = [i for i in range(len(reqs)) if i not in bad]
    for i in sorted(bad):
        failed[reqs[i].request_id] = "the model produced non-finite logits"
    if not rows:
        return token_ids, logprobs, failed
    groups: list[list[ScheduledRequest]]
    results: list[tuple[list[int], list[LogprobsEntry | None]]]
    if greedy is not None:
        ids, entries, _ = greedy
        groups = [[reqs[i] for i in rows]]
        results = [([ids[i] for i in rows], [entries[i] for i in rows])]
    else:
        groups, results = _sample_rows(sampler, logits, reqs, rows, grammar, bitmask, failed)
    for group, (ids, entries) in zip(groups, results, strict=True):
        for req, token_id, entry in zip(group, ids, entries, strict=True):
            if not 0 <= token_id < vocab:
                failed[req.request_id] = (
                    f"sampling produced token id {token_id}, outside the vocabulary [0, {vocab})"
                )
                continue
            token_ids[req.request_id] = token_id
            if entry is not None:
                logprobs[req.request_id] = entry
    return token_ids, logprobs, failed


def _sample_rows(
    sampler: Sampler,
    logits: torch.Tensor,
    reqs: list[ScheduledRequest],
    rows: list[int],
    grammar: GrammarBitmask | None,
    bitmask: RowBitmask | None,
    failed: dict[str, str],
) -> tuple[list[list[ScheduledRequest]], list[tuple[list[int], list[LogprobsEntry | None]]]]:
    """``rows`` of ``logits`` through ``Sampler.sample``, as one batch, or row by row when the
    batch raises (a row that raises alone fails, in ``failed``): the request groups and their
    (ids, logprobs entries). ``bitmask``: ``grammar``'s rows for all of ``reqs``."""
    whole = len(rows) == len(reqs)
    sub = logits if whole else logits[rows]  # [M, V]
    sub_reqs = [reqs[i] for i in rows]
    results: list[tuple[list[int], list[LogprobsEntry | None]]] = []
    groups: list[list[ScheduledRequest]] = []
    try:
        batch_mask = bitmask if whole else match_bitmask_rows(grammar, sub_reqs)
        results.append(sampler.sample(sub, sub_reqs, batch_mask))
        groups.append(sub_reqs)
    except Exception:  # noqa: BLE001 - isolated below, row by row
        logger.warning("sampling a batch of %d rows raised; retrying row by row", len(rows))
        results, groups = [], []
        for j, req in enumerate(sub_reqs):
            try:
                results.append(
                    sampler.sample(sub[j : j + 1], [req], match_bitmask_rows(grammar, [req]))
                )
                groups.append([req])
            except Exception as e:  # noqa: BLE001 - this request's own fault
                logger.warning("sampling failed for %s: %r", req.request_id, e)
                failed[req.request_id] = f"sampling failed: {e!r}"
    return groups, results
