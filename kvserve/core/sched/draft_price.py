"""The price of a verified draft position, measured on this machine from the engine's steps.

The speculation cost model (``speculate.py``) prices one draft token at ``c`` decode steps
at batch 1: a verification of ``k`` drafts costs ``1 + c k`` decode steps. ``c`` is what one
more row costs in the step's kernels, and that depends on the CPU: on the embedded model a
verified position cost 0.27 of a decode step on a Zen 3 EPYC (AVX2: the int8-dot rows are
arithmetic-bound) and about 0.07 on a Zen 4 EPYC (AVX-512 VNNI: flat up to 4 rows while the
weights stream; docs/speculative.md). A constant tuned on one of them would over- or
under-speculate on the other.

So, unless the user sets ``draft_token_cost``, the n-gram speculator measures it from the
engine's step records (``step_cost.step_record``), one-request steps only:

- a plain decode step (one decode token, no prefill, no drafts) gives the decode time;
- a verification step (its one request computes ``1 + k`` positions, ``k`` of them drafts)
  gives ``(seconds - the latest decode step's seconds) / k`` per draft position;
- ``c`` = median per-position time / median decode time, over the latest ``window`` of
  each, clamped to [0, 1]; until ``min_samples`` of each are seen, the prior.

NOTE: medians, not means: a step that a page fault or another process stretched by 10x
would move a mean for many steps. Batches of more than one request are left out: there the
cost model interpolates from this batch-1 price up to 1 at ``disable_by_batch_size``.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping


class MeasuredDraftPrice:
    """``c`` of the speculation cost model, measured from one-request steps (module doc)."""

    def __init__(self, prior: float, *, window: int = 64, min_samples: int = 8) -> None:
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior must be in [0, 1], got {prior!r}")
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"need 1 <= min_samples <= window, got {min_samples}, {window}")
        self.prior = prior
        self.min_samples = min_samples
        self._decode: deque[float] = deque(maxlen=window)
        self._per_position: deque[float] = deque(maxlen=window)
        self._cost: float | None = None  # recomputed on the next read after a new sample

    def observe(self, record: Mapping[str, float]) -> None:
        """Take one executed step's record; steps of more than one request are ignored."""
        seconds = record["seconds"]
        if record["num_seqs"] != 1 or not seconds > 0.0:
            return
        drafts = int(record.get("num_spec_tokens", 0))
        prefill = int(record["num_prefill_tokens"])
        if drafts == 0 and prefill == 0 and int(record["num_decode_tokens"]) == 1:
            self._decode.append(seconds)
        elif drafts > 0 and prefill == drafts + 1 and self._decode:
            # NOTE: the decode time of the latest steps, not the median of the window: the
            # context grows with the stream, and so does every step.
            self._per_position.append((seconds - self._decode[-1]) / drafts)
        else:
            return
        self._cost = None

    @property
    def measured(self) -> bool:
        """Whether enough steps of both kinds were seen to replace the prior."""
        return min(len(self._decode), len(self._per_position)) >= self.min_samples

    def cost(self) -> float:
        """The price of one draft position in batch-1 decode steps (the prior until measured)."""
        if self._cost is None:
            if not self.measured:
                self._cost = self.prior
            else:
                ratio = statistics.median(self._per_position) / statistics.median(self._decode)
                self._cost = min(1.0, max(0.0, ratio))
        return self._cost
