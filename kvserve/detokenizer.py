"""Incremental detokenization with stop strings.

Decoding uses prefix/read offsets (vLLM's ``detokenize_incrementally``): each call decodes
only a short window ``ids[prefix_offset:]`` and subtracts the text of
``ids[prefix_offset:read_offset]``, so the cost per call is O(new tokens), and tokenizers whose
decoders depend on context (SentencePiece's leading space) still join up correctly.
"""

from __future__ import annotations

from typing import Protocol

from kvserve.sampling_params import SamplingParams

__all__ = ["IncrementalDetokenizer", "TokenDecoder"]


class TokenDecoder(Protocol):
    """What the detokenizer needs of a tokenizer (``kvserve.tokenizer.Tokenizer`` has it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


# Prompt tokens decoded as left context for the first output tokens.
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"
# NOTE: a window that still ends in U+FFFD after this many unread tokens is not an
# incomplete character (one needs at most 4 bytes) but a genuine replacement character,
# so it is emitted rather than held forever (which would also make decoding O(n) per call).
MAX_UNREAD_TOKENS = 16


class IncrementalDetokenizer:
    """Turns the output tokens of one request into text, a delta at a time.

    ``add_tokens`` returns only new, complete text: never half a UTF-8 character, never
    text past a matched stop string, and (while streaming) never the trailing characters
    that could be the start of a stop string. When the request ends for another reason
    (eos, length, abort), call ``flush()`` to release held-back text. The concatenation of
    all returned deltas always equals ``text``.

    Stop strings are only looked for in the text after the first ``min_tokens`` output tokens
    (a match may start before it), as vLLM v1 does.

    Attributes:
        token_ids: every output token fed so far (also those fed after a stop match).
        stop_matched: the stop string that ended the text, or None.
    """

    def __init__(
        self, tokenizer: TokenDecoder, params: SamplingParams, prompt_token_ids: list[int]
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop_strings: list[str] = params.all_stop_strings
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.token_ids: list[int] = []
        self.stop_matched: str | None = None
        self._max_stop_len = max((len(s) for s in self.stop_strings), default=0)
        # Decode window state: _ids = prompt context + output ids.
        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        # Text state: emitted deltas, the last chars of emitted text (stop-string search
        # context) and decoded text held back because it may begin a stop string.
        self._parts: list[str] = []
        self._text_cache: str | None = ""
        self._tail = ""
        self._pending = ""
        self._flushed = False

    @property
    def text(self) -> str:
        """All text returned so far (the concatenation of the deltas)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._parts)
        return self._text_cache

    @property
    def finished(self) -> bool:
        """True after a stop string matched or ``flush()`` was called."""
        return self.stop_matched is not None or self._flushed

    def add_tokens(self, new_token_ids: list[int], *, stop_token: bool = False) -> str:
        """Feed output tokens (one or several); return the new text they complete.

        ``stop_token``: the last one ended the request (EOS or one of ``stop_token_ids``); it
        joins ``token_ids`` but its text is left out unless ``include_stop_str_in_output``,
        as a matched stop string's is (vLLM does the same)."""
        before = len(self.token_ids)
        self.token_ids.extend(new_token_ids)
        if self.finished or not new_token_ids:
            return ""
        if stop_token and not self.include_stop:
            new_token_ids = new_token_ids[:-1]
        # NOTE: the text of the first min_tokens tokens is never searched for a stop string
        # (vLLM v1), also when one call feeds tokens from both sides of that line.
        unsearched = min(len(new_token_ids), max(0, self.min_tokens - before))
        head = ""
        if unsearched:
            self._ids.extend(new_token_ids[:unsearched])
            head = self._emit(self._decode_new(force=False), final=False, search=False)
            new_token_ids = new_token_ids[unsearched:]
        self._ids.extend(new_token_ids)
        return head + self._emit(self._decode_new(force=False), final=False, search=True)

    def flush(self) -> str:
        """Release all held-back text (a partial stop string, an unfinished character shown
        as U+FFFD). Call once when the request finishes without a stop-string match."""
        if self.finished:
            return ""
        search = len(self.token_ids) > self.min_tokens
        delta = self._emit(self._decode_new(force=True), final=True, search=search)
        self._flushed = True
        return delta

    # --------------------------------------------------------------------------- decoding
    def _decode_new(self, force: bool) -> str:
        """Text completed by the unread ids ``_ids[_read_offset:]``; "" if it would end in
        half a character (unless ``force``)."""
        if self._read_offset >= len(self._ids):
            return ""
        decode = self.tokenizer.decode
        window = self._ids[self._prefix_offset :]
        num_prefix = self._read_offset - self._prefix_offset
        prefix_text = decode(window[:num_prefix], self.skip_special_tokens)
        new_text = decode(window, self.skip_special_tokens)
        num_unread = len(window) - num_prefix
        num_keep = 0  # trailing ids of an unfinished character, left unread
        if not force:
            if len(new_text) <= len(prefix_text):
                # Nothing visible yet (e.g. a skipped special token): keep the window.
                return ""
            if new_text.endswith(REPLACEMENT_CHAR):
                if num_unread < MAX_UNREAD_TOKENS:
                    return ""  # an unfinished multi-byte character: wait for its other bytes
                # NOTE: many unread ids can still end in half a character (ids arriving in
                # chunks that each end mid-character): emit up to the last whole character.
                for k in range(1, min(4, num_unread)):
                    head = decode(window[:-k], self.skip_special_tokens)
                    if not head.endswith(REPLACEMENT_CHAR) and len(head) > len(prefix_text):
                        num_keep, new_text = k, head
                        break
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids) - num_keep
        # NOTE: drop ids left of the window so memory does not grow with the output.
        if self._prefix_offset > 4 * INITIAL_CONTEXT_TOKENS:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text[len(prefix_text) :]

    # ------------------------------------------------------------------------ stop strings
    def _emit(self, new_text: str, final: bool, search: bool) -> str:
        """Run stop-string checks over the new text (if ``search``) and return what may be
        shown now."""
        if not self.stop_strings:
            return self._append(new_text)
        tail = self._tail
        window = tail + self._pending + new_text
        num_checked = len(window) - len(new_text)
        if new_text and search:
            hit = self._find_stop(window, num_checked)
            if hit is not None:
                start, stop = hit
                cut = start + len(stop) if self.include_stop else start
                self.stop_matched = stop
                self._pending = ""
                # NOTE: a match never starts inside emitted text: that text was held back.
                return self._append(window[len(tail) : max(cut, len(tail))])
        hold = 0 if (final or self.include_stop) else self._partial_stop_len(window)
        hold = min(hold, len(window) - len(tail))
        end = len(window) - hold
        self._pending = window[end:]
        delta = window[len(tail) : end]
        keep = self._max_stop_len - 1
        self._tail = (tail + delta)[-keep:] if keep > 0 else ""
        return self._append(delta)

    def _find_stop(self, window: str, num_checked: int) -> tuple[int, str] | None:
        """Earliest stop string in ``window`` that ends past ``num_checked`` (a new match)."""
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            idx = window.find(stop, max(0, num_checked - len(stop) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        return best

    def _partial_stop_len(self, window: str) -> int:
        """Length of the longest suffix of ``window`` that is a proper prefix of a stop."""
        best = 0
        for stop in self.stop_strings:
            for k in range(min(len(stop) - 1, len(window)), best, -1):
                if window.endswith(stop[:k]):
                    best = k
                    break
        return best

    def _append(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
            self._text_cache = None
        return delta
