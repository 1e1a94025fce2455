"""Tokenization off the engine thread, shared fairly between clients, and the byte bound
that rejects a prompt too long to fit before any of it is tokenized.

``run_job`` runs tokenization, template rendering and constraint compiles on two lanes
of threads: jobs on less than ``LARGE_JOB_BYTES`` of text take the small lane, bigger ones
(and constraint compiles, whose cost the text does not tell) the large lane. A request's job
holds one thread; a wave of big prompts fills the large lane only, so a small request waits
behind other small jobs (each bounded) and never behind another client's large text.

``max_prompt_bytes``: a token spells at most the vocabulary's longest token in bytes, so a
text longer than ``max_model_len`` such tokens cannot fit in the context whatever its
tokenization; it is a 400 before the tokenizer sees it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvserve.server.errors import APIError

T = TypeVar("T")

LARGE_JOB_BYTES = 16 << 10  # 16 KiB of text: ~4k tokens, a few ms to tokenize
LARGE = 1 << 62  # the size of a job whose cost its text does not tell (a constraint compile)
# NOTE: an unknown character is one (unknown) token of at most 4 UTF-8 bytes.
_MIN_TOKEN_BYTES = 4

# NOTE: module-level: the Rust tokenizer releases the GIL while it encodes, so these threads
# run beside the event loop; shared by every app of the process (tests build many).
_SMALL_LANE = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvserve-tokenize")
_LARGE_LANE = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvserve-tokenize-large")


async def run_job(fn: Callable[[], T], size: int = 0) -> T:
    """``fn()`` on a tokenizer thread: the small lane for ``size`` (bytes of text) under
    ``LARGE_JOB_BYTES``, else the large lane."""
    lane = _SMALL_LANE if size < LARGE_JOB_BYTES else _LARGE_LANE
    return await asyncio.get_running_loop().run_in_executor(lane, fn)


def longest_token_bytes(decode: Callable[[list[int]], str], num_tokens: int) -> int:
    """The most UTF-8 bytes one of the ``num_tokens`` ids spells (special tokens too: their
    markup in a text is read as them), and at least 4 (an unknown character).

    NOTE: an upper bound, as the check needs: an id that is part of a UTF-8 character
    decodes to U+FFFD (3 bytes, at least as many as it spells), and one byte is added for
    the leading space a SentencePiece decode drops from a lone word token. (A normalizer
    that shrinks text, NFKC's composed forms, could beat it only with a text of nothing but
    such characters, all in the longest tokens.)
    """
    longest = 0
    for token_id in range(num_tokens):
        longest = max(longest, len(decode([token_id]).encode("utf-8", "replace")))
    return max(_MIN_TOKEN_BYTES, longest + 1)


def text_bytes(*texts: str) -> int:
    """UTF-8 bytes of ``texts`` together (a surrogate counts its 3 bytes)."""
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


def check_fits(max_prompt_bytes: int | None, num_bytes: int, param: str) -> None:
    """400 (``context_length_exceeded``, naming ``param``) when ``num_bytes`` of text cannot
    fit in the context: more than ``max_prompt_bytes`` (None: no bound)."""
    if max_prompt_bytes is not None and num_bytes > max_prompt_bytes:
        raise APIError(
            f"{param} has {num_bytes} bytes of text, more than the {max_prompt_bytes} that "
            "this model's context length can hold (max_model_len tokens of at most the "
            "vocabulary's longest token each)",
            param=param,
            code="context_length_exceeded",
        )
