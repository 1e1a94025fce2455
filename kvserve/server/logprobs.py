"""Logprobs of generated (and echoed prompt) tokens, in the completions and the chat format.

One path: ``token_logprobs`` reads the engine's entries into (token text, its logprob, its top
alternatives); the two formatters only lay that out as each API does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.core.outputs import LogprobsEntry
from kvserve.server import protocol as p
from kvserve.server.context import ServingContext


@dataclass
class TokenLogprob:
    """One token: its text, its logprob (None if the engine did not report it) and the top
    ``num_top`` alternatives as (text, logprob), best first."""

    text: str
    logprob: float | None
    top: list[tuple[str, float]]


def token_logprobs(
    ctx: ServingContext,
    token_ids: Sequence[int],
    entries: Sequence[LogprobsEntry],
    start: int,
    num_top: int,
) -> list[TokenLogprob]:
    """The tokens ``token_ids[start:]`` with their logprob entries."""
    out = []
    for tid, entry in zip(token_ids[start:], entries[start:], strict=False):
        chosen = entry.get(tid)
        top = sorted(entry.items(), key=lambda kv: kv[1].rank)[:num_top]
        out.append(
            TokenLogprob(
                text=ctx.token_text(tid),
                logprob=chosen.logprob if chosen is not None else None,
                top=[(ctx.token_text(t), lp.logprob) for t, lp in top],
            )
        )
    return out


def completion_logprobs(
    ctx: ServingContext,
    token_ids: Sequence[int],
    entries: Sequence[LogprobsEntry] | None,
    start: int,
    num_top: int | None,
    offset: int = 0,
) -> p.CompletionLogProbs | None:
    """The completions API's logprobs of ``token_ids[start:]`` (None unless asked for);
    ``text_offset`` counts from ``offset``, the length of the choice's text before them."""
    if num_top is None or entries is None:
        return None
    out = p.CompletionLogProbs()
    for tok in token_logprobs(ctx, token_ids, entries, start, num_top):
        out.tokens.append(tok.text)
        out.token_logprobs.append(tok.logprob)
        # NOTE: as OpenAI's legacy API, the chosen token is always among its step's
        # alternatives, so a dict holds up to logprobs + 1 entries (logprobs=0: the chosen).
        top = dict(tok.top)
        if tok.logprob is not None:
            top.setdefault(tok.text, tok.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(tok.text)
    return out


def chat_logprobs(
    ctx: ServingContext,
    token_ids: Sequence[int],
    entries: Sequence[LogprobsEntry] | None,
    start: int,
    num_top: int | None,
) -> p.ChatLogProbs | None:
    """The chat API's logprobs of ``token_ids[start:]`` (None unless asked for)."""
    if num_top is None or entries is None:
        return None
    content = [
        p.ChatTokenLogprob(
            token=tok.text,
            logprob=tok.logprob if tok.logprob is not None else float("-inf"),
            bytes=list(tok.text.encode()),
            top_logprobs=[
                p.TopLogprob(token=text, logprob=lp, bytes=list(text.encode()))
                for text, lp in tok.top
            ],
        )
        for tok in token_logprobs(ctx, token_ids, entries, start, num_top)
    ]
    return p.ChatLogProbs(content=content)
