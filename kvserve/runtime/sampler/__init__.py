"""Token sampling: penalties, min_tokens, greedy, temperature, min-p, top-k, top-p, seeds,
and logprobs, over a batch of logits rows (one row per request that samples this step).

Order of operations (as vLLM v1):
  raw logits -> logprobs (if asked; see below)
  -> repetition / presence / frequency penalties -> min_tokens mask
  -> greedy rows: argmax
  -> random rows: / temperature -> min-p -> top-k -> top-p -> softmax -> draw.

Logprobs are vLLM's default ("raw logprobs"): the log-softmax of the model's logits before
penalties, temperature and truncation, so they describe the model, not the sampler.

Drawing is inverse-CDF sampling: one uniform number per row, looked up in the row's
cumulative probabilities. A seeded row's number is a function of (seed, output position) alone
(``seeded_uniform``), so a seeded request gets the same tokens whatever batch it runs in, and
however often a step is attempted: a step that fails and is run again (the engine's fault
isolation bisects a faulted step; ``sample_guarded`` retries a batch row by row) draws the
same number again, where a generator that advanced on the failed attempt would not. Unseeded
rows share the sampler's generator.
NOTE: vLLM's exponential race (``argmax(probs / Exp(1))``) is equivalent but needs V random
numbers per row; on CPU drawing them cost ~50 ms for 64 x 49152 logits against ~2 ms here.

Modules: this one holds the ``Sampler`` (row plans, the draw, seeds); ``filters.py`` the
penalties and the temperature / min-p / top-k / top-p truncation, ``greedy.py`` the argmax
fast path (the native kernel), ``logprobs.py`` the raw logprobs entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.core.outputs import LogprobsEntry, ScheduledRequest
from kvserve.runtime.logits_constraints import RowBitmask, apply_logit_bias, apply_token_bitmask
from kvserve.runtime.sampler.filters import apply_penalties, truncated_probs
from kvserve.runtime.sampler.greedy import argmax, argmax_checked
from kvserve.runtime.sampler.logprobs import logprobs_entries

__all__ = ["Sampler", "seeded_uniform"]


@dataclass(slots=True)
class _RowPlan:
    """What one request needs from this step (built once per row)."""

    greedy: bool
    penalized: bool
    min_tokens_ids: list[int] | None  # ids to mask until min_tokens reached


class Sampler:
    """Samples one token per logits row.

    Args:
        vocab_size: number of real tokens; logits columns past it (padding) are never sampled.
        seed: seed of the generator shared by requests without their own seed.
        eos_token_id: masked, with ``stop_token_ids``, until a request has ``min_tokens``.
    """

    def __init__(self, vocab_size: int, seed: int = 0, eos_token_id: int | None = None) -> None:
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"Sampler.vocab_size must be an int >= 1, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.seed = seed
        self.eos_token_id = eos_token_id
        # NOTE: the only generator state held; seeded rows keep none (``seeded_uniform``),
        # so nothing per request outlives its request.
        self._shared_gen: dict[torch.device, torch.Generator] = {}

    # ------------------------------------------------------------------------------ sample
    def sample(
        self,
        logits: torch.Tensor,
        reqs: list[ScheduledRequest],
        token_bitmask: RowBitmask | None = None,
    ) -> tuple[list[int], list[LogprobsEntry | None]]:
        """Sample one token for each row of ``logits`` ([N, V], any float dtype, row i = reqs[i]).

        Returns the token ids and, per row, a LogprobsEntry (the sampled token plus the
        top-N raw logprobs) when that request asked for logprobs, else None.
        The caller's tensor is not modified. ``token_bitmask`` (structured output) and each
        request's ``logit_bias`` edit a copy of the logits before everything else.
        """
        self._check_logits(logits, reqs)
        if not reqs:
            return [], []
        raw_logits = logits[:, : self.vocab_size]  # [N, V], the caller's dtype
        plans = [self._plan(r) for r in reqs]
        edited = _edited(reqs, token_bitmask)
        plain_greedy = _plain_greedy(plans)
        if not edited and plain_greedy:
            # Fast path: the common all-greedy batch is a single argmax, on the logits as the
            # model wrote them.
            # NOTE: widening bf16 (or fp16) to float is exact, so the argmax is the same; the
            # widened copy (6.3 MB at B=32 on the embedded model) cost ~0.5 ms a decode step,
            # and the native argmax reads half the bytes.
            token_ids: list[int] = argmax(raw_logits).tolist()
            return token_ids, logprobs_entries(raw_logits, token_ids, reqs)
        logits = raw_logits.float()  # [N, V]
        if edited:
            logits = logits.clone(memory_format=torch.contiguous_format)  # [N, V]
            apply_logit_bias(logits, reqs)
            if token_bitmask is not None:
                apply_token_bitmask(logits, token_bitmask)
                # NOTE: the grammar decides where a constrained output may end; masking EOS
                # for min_tokens there could leave a row with no allowed token.
                for i in token_bitmask.rows:
                    plans[i].min_tokens_ids = None
        if plain_greedy:
            token_ids = argmax(logits).tolist()  # greedy, after the bitmask or biases
        else:
            token_ids = self._sample_mixed(logits, reqs, plans)
        return token_ids, logprobs_entries(raw_logits, token_ids, reqs)

    def sample_greedy_checked(
        self,
        logits: torch.Tensor,
        reqs: list[ScheduledRequest],
        token_bitmask: RowBitmask | None = None,
    ) -> tuple[list[int], list[LogprobsEntry | None], list[int]] | None:
        """``sample``'s all-greedy path with the non-finite check in the same pass over the
        logits: (token id per row, logprobs entry per row, the rows holding a NaN or an
        infinity among the first ``vocab_size`` logits, whose id and entry mean nothing).

        None where that path does not apply (a bitmask, a logit bias, a penalty, min_tokens or
        a sampled row) or the native kernel cannot take the logits: the caller then checks the
        logits itself and calls ``sample``.
        """
        self._check_logits(logits, reqs)
        if not reqs or _edited(reqs, token_bitmask):
            return None
        if not _plain_greedy([self._plan(r) for r in reqs]):
            return None
        raw_logits = logits[:, : self.vocab_size]  # [N, V], the caller's dtype
        checked = argmax_checked(raw_logits)
        if checked is None:
            return None
        ids, finite = checked
        token_ids: list[int] = ids.tolist()
        bad = [i for i, ok in enumerate(finite.tolist()) if not ok]
        if not bad:
            return token_ids, logprobs_entries(raw_logits, token_ids, reqs), []
        bad_rows = set(bad)
        good = [i for i in range(len(reqs)) if i not in bad_rows]
        entries: list[LogprobsEntry | None] = [None] * len(reqs)
        if good:
            sub = logprobs_entries(
                raw_logits[good], [token_ids[i] for i in good], [reqs[i] for i in good]
            )
            for i, entry in zip(good, sub, strict=True):
                entries[i] = entry
        return token_ids, entries, bad

    def _check_logits(self, logits: torch.Tensor, reqs: list[ScheduledRequest]) -> None:
        if logits.dim() != 2 or logits.shape[0] != len(reqs):
            raise ValueError(
                f"Sampler.sample: logits must be [len(reqs)={len(reqs)}, V], "
                f"got {tuple(logits.shape)}"
            )
        if logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"Sampler.sample: logits have {logits.shape[1]} columns, fewer than "
                f"vocab_size={self.vocab_size}"
            )

    def _plan(self, req: ScheduledRequest) -> _RowPlan:
        p = req.sampling_params
        penalized = (
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        )
        masked: list[int] | None = None
        if len(req.output_token_ids) < p.min_tokens:
            masked = list(p.stop_token_ids or [])
            if self.eos_token_id is not None and not p.ignore_eos:
                masked.append(self.eos_token_id)
            masked = [t for t in masked if t < self.vocab_size] or None
        return _RowPlan(greedy=p.greedy, penalized=penalized, min_tokens_ids=masked)

    def _sample_mixed(
        self, logits: torch.Tensor, reqs: list[ScheduledRequest], plans: list[_RowPlan]
    ) -> list[int]:
        """General path: penalties and masks, then greedy and random rows separately."""
        if any(p.penalized or p.min_tokens_ids is not None for p in plans):
            # [N, V]; never modify the caller's tensor (contiguous: penalties use a flat view)
            logits = logits.clone(memory_format=torch.contiguous_format)
            if any(p.penalized for p in plans):
                apply_penalties(logits, reqs)
            for i, plan in enumerate(plans):
                if plan.min_tokens_ids is not None:
                    logits[i, plan.min_tokens_ids] = float("-inf")

        token_ids = [0] * len(reqs)
        greedy_rows = [i for i, p in enumerate(plans) if p.greedy]
        random_rows = [i for i, p in enumerate(plans) if not p.greedy]
        if greedy_rows:
            picked = argmax(_rows(logits, greedy_rows)).tolist()
            for i, t in zip(greedy_rows, picked, strict=True):
                token_ids[i] = t
        if random_rows:
            sub = [reqs[i] for i in random_rows]
            probs, cand_ids = truncated_probs(
                _rows(logits, random_rows), [r.sampling_params for r in sub]
            )
            for i, t in zip(random_rows, self._draw(probs, cand_ids, sub), strict=True):
                token_ids[i] = t
        return token_ids

    def _draw(
        self, probs: torch.Tensor, cand_ids: torch.Tensor | None, reqs: list[ScheduledRequest]
    ) -> list[int]:
        """Inverse-CDF draw from probs [M, V] (or [M, C] over the token ids ``cand_ids``),
        one uniform per row from that row's generator (its own when seeded, else shared)."""
        num_rows, device = probs.shape[0], probs.device
        uniforms = torch.empty(num_rows, dtype=torch.float64, device=device)  # [M]
        shared_rows: list[int] = []
        for j, req in enumerate(reqs):
            if req.seed is None:
                shared_rows.append(j)
            else:
                uniforms[j] = seeded_uniform(req.seed, len(req.output_token_ids))
        if shared_rows:
            shared = torch.rand(
                len(shared_rows),
                generator=self._shared_generator(device),
                dtype=torch.float64,
                device=device,
            )
            uniforms[shared_rows] = shared
        cdf = probs.cumsum(dim=-1)  # [M, V], non-decreasing; flat over zero-probability tokens
        total = cdf[:, -1:]  # [M, 1]
        # NOTE: the target must stay strictly below the row's total, or searchsorted would
        # run past the last token with non-zero probability.
        target = torch.minimum(
            uniforms.to(cdf.dtype).unsqueeze(1) * total,
            torch.nextafter(total, torch.zeros_like(total)),
        )  # [M, 1]
        picked = torch.searchsorted(cdf, target, right=True)  # [M, 1]
        if cand_ids is not None:
            picked = cand_ids.gather(1, picked)
        return picked.squeeze(1).tolist()

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared_gen.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._shared_gen[device] = gen
        return gen


# ------------------------------------------------------------------------------ seeds
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele et al.): a well-mixed 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) a request seeded with ``seed`` draws for its output token
    number ``position`` (0 for the first).

    A pure function: no generator state advances, so drawing again for the same position (a
    step re-run after a fault, a row retried alone) gives the same number, and a recompute
    preemption (which keeps the tokens drawn so far) continues the same sequence.
    NOTE: 53 random bits, the precision of a float64 in [0, 1). Any int seed is accepted
    (negative ones are taken modulo 2**64).
    """
    bits = _splitmix64((_splitmix64(seed & _MASK64) + position) & _MASK64)
    return (bits >> 11) * (1.0 / (1 << 53))


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]`` ([len(rows), V]); ``logits`` itself, not a copy, when ``rows`` is every
    row in order (a batch that is all greedy or all random). Callers only read it."""
    if len(rows) == logits.shape[0]:  # rows are distinct, ascending: every row in order
        return logits
    return logits[rows]


def _edited(reqs: list[ScheduledRequest], token_bitmask: RowBitmask | None) -> bool:
    """Whether the logits are edited before sampling (a grammar bitmask or a logit bias)."""
    return token_bitmask is not None or any(r.sampling_params.logit_bias for r in reqs)


def _plain_greedy(plans: list[_RowPlan]) -> bool:
    """Whether every row is a plain argmax (greedy, no penalty, no min_tokens)."""
    return all(p.greedy and not p.penalized and p.min_tokens_ids is None for p in plans)
