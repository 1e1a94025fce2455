"""Verifying draft tokens (speculative decoding): the target samples at every draft position.

A request scheduled with ``k`` draft tokens (``ScheduledRequest.spec_token_ids``) computes
``1 + k`` positions in one forward: its last known token, then the drafts. Its logits rows
are those ``k + 1`` positions; row ``j`` is sampled as the request would sample its next
token with the first ``j`` drafts appended to its output (``spec_rows``: penalties, min_tokens
and the seeded draw of that output position all see them). ``fold_verified`` then accepts the
drafts while each equals the token sampled before it, and reports the token sampled after the
last accepted one.

Why this is exact (Leviathan et al. 2023, Chen et al. 2023): the drafts here are deterministic
(n-gram lookup, or a draft model's argmax), so the draft distribution ``q`` is one-hot and
the rejection rule reduces to: accept draft ``d`` with probability ``p(d)``, else sample from
``p`` with ``d`` removed, renormalized. Drawing ``t ~ p`` and accepting iff ``t == d`` does
exactly that (``P(t == d) = p(d)``; given ``t != d``, ``t`` follows the residual), and the
token after the last accepted draft is the target's own sample. So every output token is a
draw of the target's distribution at its position: greedy output is plain decoding's, and a
seeded request draws the same uniform number per output position as plain decoding does
(``seeded_uniform(seed, position)``), so it yields the same tokens too.
"""

from __future__ import annotations

import dataclasses

from kvserve.core.outputs import ModelRunnerOutput, ScheduledRequest

# A verification row's id: the request's id, this separator, the draft position.
ROW_SEP = "\x00spec"


def spec_rows(r: ScheduledRequest) -> list[ScheduledRequest]:
    """The ``k + 1`` sampling rows of a request with ``k`` drafts (module docstring)."""
    drafts = r.spec_token_ids
    return [
        dataclasses.replace(
            r,
            request_id=f"{r.request_id}{ROW_SEP}{j}",
            output_token_ids=r.output_token_ids + drafts[:j],
            spec_token_ids=[],
        )
        for j in range(len(drafts) + 1)
    ]


def fold_verified(out: ModelRunnerOutput, spec_requests: list[ScheduledRequest]) -> None:
    """Replace the verification rows' results in ``out`` by one result per request: the
    accepted drafts' count (``spec_num_accepted``) and the token sampled after them
    (``sampled_token_ids``). A request any of whose rows failed fails with that reason."""
    sampled, failed = out.sampled_token_ids, out.failed
    for r in spec_requests:
        rid, k = r.request_id, len(r.spec_token_ids)
        ids = [f"{rid}{ROW_SEP}{j}" for j in range(k + 1)]
        tokens = [sampled.pop(i, None) for i in ids]
        out.logprobs.pop(rid, None)
        for i in ids:
            out.logprobs.pop(i, None)
        reasons = [failed.pop(i) for i in ids if i in failed]
        if reasons or any(t is None for t in tokens):
            failed[rid] = reasons[0] if reasons else "a verification row was not sampled"
            continue
        accepted = 0
        while accepted < k and tokens[accepted] == r.spec_token_ids[accepted]:
            accepted += 1
        sampled[rid] = tokens[accepted]  # type: ignore[assignment]
        out.spec_num_accepted[rid] = accepted
