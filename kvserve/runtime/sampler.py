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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve.core.outputs import Logprob, LogprobsEntry, ScheduledRequest
from kvserve.runtime import native
from kvserve.runtime.logits_constraints import RowBitmask, apply_logit_bias, apply_token_bitmask
from kvserve.sampling_params import SamplingParams

__all__ = ["Sampler", "apply_penalties", "seeded_uniform"]

# Top-p first looks for the nucleus among this many most likely tokens (a top-k, cheap); only
# the rows whose mass falls short of top_p search again among _TOP_P_WIDEN times as many,
# and the whole vocabulary is sorted only for rows that still fall short.
# NOTE: most rows find their nucleus among 256 candidates and almost all among 4096, and a
# wide topk costs far more than a narrow one, so only the rows that fall short widen (the
# measurements: bench/README.md, "Measurements behind constants in the code").
_TOP_P_CANDIDATES = 256
_TOP_P_WIDEN = 16


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
            token_ids: list[int] = _argmax(raw_logits).tolist()
            return token_ids, _logprobs_entries(raw_logits, token_ids, reqs)
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
            token_ids = _argmax(logits).tolist()  # greedy, after the bitmask or biases
        else:
            token_ids = self._sample_mixed(logits, reqs, plans)
        return token_ids, _logprobs_entries(raw_logits, token_ids, reqs)

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
        checked = _argmax_checked(raw_logits)
        if checked is None:
            return None
        ids, finite = checked
        token_ids: list[int] = ids.tolist()
        bad = [i for i, ok in enumerate(finite.tolist()) if not ok]
        if not bad:
            return token_ids, _logprobs_entries(raw_logits, token_ids, reqs), []
        bad_rows = set(bad)
        good = [i for i in range(len(reqs)) if i not in bad_rows]
        entries: list[LogprobsEntry | None] = [None] * len(reqs)
        if good:
            sub = _logprobs_entries(
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
            picked = _argmax(_rows(logits, greedy_rows)).tolist()
            for i, t in zip(greedy_rows, picked, strict=True):
                token_ids[i] = t
        if random_rows:
            sub = [reqs[i] for i in random_rows]
            probs, cand_ids = _truncated_probs(
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


# ------------------------------------------------------------------------------ penalties
def apply_penalties(logits: torch.Tensor, reqs: list[ScheduledRequest]) -> torch.Tensor:
    """Apply each row's penalties to ``logits`` [N, V] in place (and return it).

    Repetition penalty (HF): over the set of prompt + output tokens, positive logits are
    divided by it and negative ones multiplied. Then presence / frequency penalties (OpenAI):
    over output tokens, ``logit -= presence * [count > 0] + frequency * count``.
    Works on the touched (row, token) pairs only: O(tokens), not O(N * V).
    """
    if not logits.is_contiguous():
        raise ValueError("apply_penalties: logits must be contiguous (it edits a flat view)")
    vocab = logits.shape[1]
    flat = logits.view(-1)  # [N * V]
    rep_keys: list[int] = []
    out_keys: list[int] = []
    for row, req in enumerate(reqs):
        p = req.sampling_params
        base = row * vocab
        if p.repetition_penalty != 1.0:
            rep_keys.extend(base + t for t in req.prompt_token_ids)
            rep_keys.extend(base + t for t in req.output_token_ids)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            out_keys.extend(base + t for t in req.output_token_ids)
    device = logits.device
    if rep_keys:
        keys = torch.unique(torch.tensor(rep_keys, dtype=torch.long, device=device))  # [K]
        rep = _column([r.sampling_params.repetition_penalty for r in reqs], logits).flatten()
        factor = rep[keys // vocab]  # [K]
        vals = flat[keys]
        flat[keys] = torch.where(vals > 0, vals / factor, vals * factor)
    if out_keys:
        keys, counts = torch.unique(
            torch.tensor(out_keys, dtype=torch.long, device=device), return_counts=True
        )  # [K] each
        rows = keys // vocab
        presence = _column([r.sampling_params.presence_penalty for r in reqs], logits).flatten()
        frequency = _column([r.sampling_params.frequency_penalty for r in reqs], logits).flatten()
        flat[keys] -= frequency[rows] * counts.to(logits.dtype) + presence[rows]
    return logits


# ----------------------------------------------------------------------------- truncation
def _truncated_probs(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature, then min-p, top-k and top-p masks. Returns (probs [M, V], None), or
    (probs [M, C], token ids [M, C]) over candidate tokens when every row is truncated."""
    vocab = logits.shape[1]
    logits = logits / _column([p.temperature for p in params], logits)  # [M, V]
    if any(p.min_p > 0.0 for p in params):
        # prob_i >= min_p * prob_max  <=>  logit_i >= logit_max + log(min_p)
        log_min_p = [math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in params]
        threshold = logits.amax(dim=-1, keepdim=True) + _column(log_min_p, logits)  # [M, 1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    # NOTE: top_k -1 or 0 (off) and any top_k >= the vocabulary keep the whole row (vLLM
    # clips top_k to the vocabulary).
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    rows = [j for j in range(len(params)) if top_ks[j] < vocab or top_ps[j] < 1.0]
    if len(rows) == len(params):
        # NOTE: every row is truncated, so sample among the candidates only and skip the
        # vocabulary-wide scatter, softmax and cumsum.
        vals, idx = _top_k_top_p_candidates(logits, top_ks, top_ps)  # [M, C] each
        return torch.softmax(vals, dim=-1), idx
    if rows:
        logits[rows] = _top_k_top_p(
            logits[rows], [top_ks[j] for j in rows], [top_ps[j] for j in rows]
        )
    return torch.softmax(logits, dim=-1), None


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """``logits`` [M, V] with the tokens dropped by top-k / top-p set to -inf."""
    vocab = logits.shape[1]
    vals, idx = _top_k_top_p_candidates(logits, top_ks, top_ps)  # [M, C] each
    # NOTE: one spare column receives the padding entries (id ``vocab``), then is cut off.
    out = logits.new_full((logits.shape[0], vocab + 1), float("-inf"))  # [M, V + 1]
    return out.scatter_(1, idx, vals)[:, :vocab]


def _top_k_top_p_candidates(
    logits: torch.Tensor,
    top_ks: list[int],
    top_ps: list[float],
    num_cand: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each row's top-k tokens, then the nucleus (smallest most-likely set with mass
    >= top_p, renormalised over the top-k set, as vLLM). logits: [M, V].

    Returns (candidate logits [M, C] with dropped ones at -inf, their token ids [M, C]),
    C >= every kept set. Rows whose nucleus does not fit in the first ``num_cand`` candidates
    are searched again, alone, among ``_TOP_P_WIDEN`` times as many (or the whole row when
    that provably cannot hold it); the other rows are padded to the widest C with logit -inf
    and id ``V`` (never sampled).
    """
    vocab = logits.shape[1]
    if num_cand is None:
        num_cand = min(vocab, max([_TOP_P_CANDIDATES] + [k for k in top_ks if k < vocab]))
    vals, idx, min_need = _nucleus_among(logits, top_ks, top_ps, num_cand)
    if num_cand == vocab:
        return vals, idx
    wider = min(vocab, num_cand * _TOP_P_WIDEN)
    by_width: dict[int, list[int]] = {}  # rows to search again, by their next width
    for row, need in enumerate(min_need.tolist()):
        if need > 0:
            by_width.setdefault(vocab if need > wider else wider, []).append(row)
    if not by_width:
        return vals, idx
    if len(by_width) == 1 and len(next(iter(by_width.values()))) == len(top_ks):
        # Every row goes to the same width: search them all again, nothing to merge.
        return _top_k_top_p_candidates(logits, top_ks, top_ps, num_cand=next(iter(by_width)))
    found = []  # per group: rows, [W, C'] logits, [W, C'] ids
    for width, rows in by_width.items():
        ks, ps = [top_ks[r] for r in rows], [top_ps[r] for r in rows]
        found.append((rows, *_top_k_top_p_candidates(logits[rows], ks, ps, num_cand=width)))
    pad = max(wide_vals.shape[1] for _, wide_vals, _ in found) - num_cand
    vals = torch.nn.functional.pad(vals, (0, pad), value=float("-inf"))  # [M, C']
    idx = torch.nn.functional.pad(idx, (0, pad), value=vocab)
    for rows, wide_vals, wide_idx in found:
        vals[rows, : wide_vals.shape[1]] = wide_vals
        idx[rows, : wide_idx.shape[1]] = wide_idx
    return vals, idx


def _nucleus_among(
    logits: torch.Tensor, top_ks: list[int], top_ps: list[float], num_cand: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k then top-p among each row's ``num_cand`` most likely tokens. logits: [M, V].

    Returns (candidate logits [M, C] with dropped ones at -inf, their ids [M, C], min_need
    [M]): min_need is 0 for rows whose kept set lies inside the candidates, else a lower
    bound on the candidates their nucleus needs (inf when the last candidate has p == 0).
    """
    vocab = logits.shape[1]
    k_col = torch.tensor(top_ks, device=logits.device).unsqueeze(1)  # [M, 1]
    has_k = k_col < vocab  # [M, 1]
    p_col = _column(top_ps, logits)  # [M, 1]
    vals, idx = torch.topk(logits, num_cand, dim=-1)  # [M, C] each, descending
    positions = torch.arange(num_cand, device=logits.device).unsqueeze(0)  # [1, C]
    vals = vals.masked_fill(positions >= k_col, float("-inf"))
    log_norm = torch.logsumexp(vals, dim=-1, keepdim=True)  # [M, 1]
    if not bool(has_k.all()):
        # Top-p renormalises over the kept top-k set; rows without top-k over the whole row.
        row_log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)  # [M, 1]
        log_norm = torch.where(has_k, log_norm, row_log_norm)
    probs = torch.exp(vals - log_norm)  # [M, C]
    cum = probs.cumsum(dim=-1)
    # Keep token i while the mass strictly before it is below top_p; always keep the first.
    drop = (cum - probs) >= p_col
    drop[:, 0] = False
    # Rows with top-k are always covered (num_cand >= k); the others once the mass reaches p.
    covered = has_k | (cum[:, -1:] >= p_col)  # [M, 1]
    # NOTE: no token past the candidates is more likely than the last one, so a short row
    # needs at least this many; the caller skips widths that provably cannot hold it.
    min_need = num_cand + (p_col - cum[:, -1:]) / probs[:, -1:]  # [M, 1]
    min_need = min_need.masked_fill(covered, 0.0).squeeze(1)  # [M]
    return vals.masked_fill(drop, float("-inf")), idx, min_need


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


def _native_rows(logits: torch.Tensor) -> bool:
    """Whether the native argmax kernel takes ``logits``: CPU [M, V>0] with contiguous rows."""
    return (
        logits.device.type == "cpu"
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.stride(-1) == 1
        and native.available()
    )


def _argmax_checked(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``_argmax`` and, from the same pass, whether each row is finite: ([M] long, [M] bool);
    None where the native kernel cannot take ``logits``."""
    if not _native_rows(logits):
        return None
    out = torch.empty(logits.shape[0], dtype=torch.long)  # [M]
    finite = torch.empty(logits.shape[0], dtype=torch.bool)  # [M]
    native.ops().argmax_rows(out, logits, finite)
    return out, finite


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Per-row argmax of ``logits`` [M, V] -> [M] long: the first maximal index, NaN counting
    as maximal, exactly as ``torch.argmax``.

    NOTE: greedy decoding runs this on every step. On CPU the native kernel (one pass keeping
    each lane's maximum and its first index) took 0.09 ms on [32, 49152] bf16 rows, 0.10 on
    float32 (two threads, the AMX Xeon, session 22), where ``max(dim).indices`` took 1.3 ms
    and ``argmax`` 2.3 ms (one thread, Zen 4); elsewhere ``max(dim).indices``.
    """
    if _native_rows(logits):
        out = torch.empty(logits.shape[0], dtype=torch.long)  # [M]
        native.ops().argmax_rows(out, logits)
        return out
    return logits.max(dim=-1).indices


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """A [M, 1] tensor of per-row values, matching ``like``'s dtype and device."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


# ------------------------------------------------------------------------------- logprobs
def _logprobs_entries(
    logits: torch.Tensor, token_ids: list[int], reqs: list[ScheduledRequest]
) -> list[LogprobsEntry | None]:
    """Per row: None, or the sampled token's raw logprob and rank (1 + tokens strictly more
    likely) followed by the top-N tokens with ranks 1..N. logits: [N, V] raw, any float
    dtype (the rows asked for are widened to float32)."""
    entries: list[LogprobsEntry | None] = [None] * len(reqs)
    rows = [i for i, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
    if not rows:
        return entries
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)  # [R, V]
    chosen_ids = torch.tensor([token_ids[i] for i in rows], device=logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, chosen_ids)  # [R, 1]
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    num_top = max(reqs[i].sampling_params.logprobs or 0 for i in rows)
    top_vals, top_ids = torch.topk(logprobs, num_top, dim=-1)  # [R, num_top] each
    chosen_list, top_val_list, top_id_list = (
        chosen.squeeze(1).tolist(),
        top_vals.tolist(),
        top_ids.tolist(),
    )
    for j, i in enumerate(rows):
        entry: LogprobsEntry = {token_ids[i]: Logprob(logprob=chosen_list[j], rank=ranks[j])}
        n = reqs[i].sampling_params.logprobs or 0
        top = zip(top_id_list[j][:n], top_val_list[j][:n], strict=True)
        for rank, (tid, val) in enumerate(top, start=1):
            if tid not in entry:
                entry[tid] = Logprob(logprob=val, rank=rank)
        entries[i] = entry
    return entries
