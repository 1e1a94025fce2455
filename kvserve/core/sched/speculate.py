"""Speculative decoding in the scheduler: drafts, their slots, their verification's outcome.

A running request that decodes (one known token left to compute) may get ``k`` draft tokens:
its step computes ``1 + k`` positions (the last known token, then the drafts), the runner
samples the target model at each of them and accepts the drafts while they equal what it
sampled (``runtime/spec_verify.py``), then the token sampled after the last accepted draft.

- **Drafts** (``Speculator.draft``): the n-gram proposer (``propose_ngram``, vLLM's prompt
  lookup) or, for a draft model, ``k`` placeholders: the runner runs the draft model over
  the slots allocated here (``runtime/draft_runner.py``) and reports the drafts it put there
  (``ModelRunnerOutput.spec_token_ids``), which ``verified`` reads.
- **How many** (``Speculator.num_to_draft``): a cost model per request. With ``a`` the
  request's acceptance rate (each draft accepted given the ones before were), ``k`` drafts
  yield ``1 + a + ... + a^k`` tokens for a step that costs ``1 + c k`` decode steps, ``c`` =
  ``SpeculativeConfig.draft_token_cost`` where set, else (n-gram) the price measured on this
  machine from one-request steps (``draft_price.MeasuredDraftPrice``). ``c`` grows linearly with
  the running requests up to 1 at ``disable_by_batch_size`` (a compute-bound step: an extra
  token costs a decode of its own, so no ``k`` pays), where speculation stops. ``k``
  maximizes yield / cost; 0 when no ``k`` beats plain decoding (``a`` below ~``c``).
- **Acceptance** per request: decayed counts (``DECAY`` per verification) of accepted and
  tested drafts, with a prior of ``PRIOR`` (weight 1). A request that stopped drafting
  decays its counts a little each step (``IDLE_DECAY``) so it tries again now and then.
- **Slots**: ``1 + k`` slots are allocated at once, all or nothing; if the pool cannot give
  them the request decodes plainly (speculation never preempts anyone). The table records
  the ``k`` lookahead slots; ``verified`` releases the blocks that held only rejected drafts.
- **Limits**: a request with logprobs or a structured-output constraint does not speculate
  (both are one entry / one grammar step per sampled token); drafts never pass
  ``max_tokens`` or ``max_model_len``. Async scheduling is refused with speculation
  (``EngineConfig``).

Figures (vLLM's names, ``SpecDecodeStats``): drafts, draft tokens, accepted tokens, accepted
tokens per draft position; acceptance rate and mean acceptance length derive from them.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.core.outputs import DRAFT_PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, ScheduledRequest
from kvserve.core.sched.draft_price import MeasuredDraftPrice
from kvserve.request import Request
from kvserve.spec_config import DEFAULT_DRAFT_TOKEN_COST, SpeculativeConfig

if TYPE_CHECKING:
    from kvserve.core.kv.kv_cache_manager import KVCacheManager

DECAY = 0.8  # weight of a request's past verifications at each new one
IDLE_DECAY = 0.95  # per step a request does not draft for lack of acceptance
PRIOR = 0.5  # prior acceptance rate, weight one tested token


def propose_ngram(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Prompt lookup: up to ``k`` tokens that followed the latest earlier occurrence of the
    last ``n`` tokens of ``tokens``, trying ``n`` from ``hi`` down to ``lo``; [] if none.

    NOTE: searched as bytes (4 per token, ``bytes.rfind`` in C, misaligned hits skipped):
    a pure-Python scan cost ~1 ms per step at 2,000 tokens.
    """
    num = len(tokens)
    if k < 1 or num < lo + 1:
        return []
    buf = array("i", tokens).tobytes()
    for n in range(min(hi, num - 1), lo - 1, -1):
        pattern = buf[-4 * n :]
        end = 4 * (num - 1)  # the occurrence must end before the last token
        while True:
            at = buf.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                start = at // 4 + n
                return tokens[start : start + k]
            end = at + 4 * n - 1
    return []


@dataclass(slots=True)
class SpecDecodeStats:
    """Speculative decoding counters (vLLM v1's ``spec_decode_*``)."""

    num_drafts: int = 0  # verifications (requests x steps with at least one draft token)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepting i + 1

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one verification of ``num_draft_tokens`` drafts, ``num_accepted`` accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def as_dict(self) -> dict[str, float | int]:
        """The counters plus acceptance rate and mean acceptance length (1 + accepted /
        drafts, vLLM's), by the names ``stats()`` and /metrics use."""
        d, t, a = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        out: dict[str, float | int] = {
            "spec_decode_num_drafts": d,
            "spec_decode_num_draft_tokens": t,
            "spec_decode_num_accepted_tokens": a,
            "spec_decode_acceptance_rate": a / t if t else 0.0,
            "spec_decode_mean_acceptance_length": 1 + a / d if d else 0.0,
        }
        for i, n in enumerate(self.accepted_per_pos):
            out[f"spec_decode_num_accepted_tokens_per_pos_{i}"] = n
        return out


def expected_gain(acceptance: float, k: int, cost: float) -> float:
    """Tokens per decode-step of time with ``k`` drafts: (1 + a + ... + a^k) / (1 + cost k)."""
    return sum(acceptance**i for i in range(k + 1)) / (1.0 + cost * k)


class Speculator:
    """Chooses each decoding request's drafts and takes its verification's outcome."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()
        # NOTE: None where the price is set: by the user, or for a draft model by the engine
        # (its verification steps also run the draft, which this measure would not tell).
        self.price = (
            MeasuredDraftPrice(DEFAULT_DRAFT_TOKEN_COST)
            if (config.draft_token_cost is None and config.method == "ngram")
            else None
        )

    def observe(self, record: Mapping[str, float]) -> None:
        """Feed one executed step's record (``LLMEngine.step_records``) to the measured price."""
        if self.price is not None:
            self.price.observe(record)

    def draft_token_cost(self, num_running: int) -> float | None:
        """The cost model's price of one draft token at ``num_running`` requests (module
        docstring); None at or past ``disable_by_batch_size``."""
        cfg = self.config
        limit = cfg.disable_by_batch_size or 1
        if num_running >= limit:
            return None
        c = cfg.draft_token_cost
        if self.price is not None:
            c = self.price.cost()
        elif c is None:  # NOTE: a draft model's cost the engine did not set (core tests)
            c = DEFAULT_DRAFT_TOKEN_COST
        return c + (1.0 - c) * (num_running - 1) / max(1, limit - 1)

    def acceptance(self, request: Request) -> float:
        """The request's estimated acceptance rate per draft token (module docstring)."""
        return (request.spec_accepted + PRIOR) / (request.spec_tested + 1.0)

    def num_to_draft(self, request: Request, num_running: int, limit: int) -> int:
        """How many drafts (at most ``limit``) pay for ``request`` now: the cost model's
        best ``k`` (``adaptive``), else ``limit``; 0 past ``disable_by_batch_size``."""
        cost = self.draft_token_cost(num_running)
        if cost is None or limit < 1:
            return 0
        if not self.config.adaptive:
            return limit
        a = self.acceptance(request)
        best, best_gain = 0, 1.0
        for k in range(1, limit + 1):
            gain = expected_gain(a, k, cost)
            if gain > best_gain:
                best, best_gain = k, gain
        if best == 0:  # NOTE: decays toward the prior, so the request tries again later
            request.spec_accepted *= IDLE_DECAY
            request.spec_tested *= IDLE_DECAY
        return best

    def limit(self, request: Request, budget: int) -> int:
        """The most drafts ``request`` may take: the config's, the step's budget after its one
        token, and what ``max_tokens`` / ``max_model_len`` leave after the sampled token."""
        params = request.sampling_params
        if params.logprobs is not None or params.structured_outputs is not None:
            return 0
        k = min(self.config.num_speculative_tokens, budget - 1)
        k = min(k, self.max_model_len - request.num_tokens)
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - request.num_output_tokens - 1)
        return max(0, k)

    def propose(self, request: Request, k: int) -> list[int]:
        """Up to ``k`` draft tokens for ``request``: n-gram prompt lookup, or ``k``
        placeholders the runner's draft model fills (``DRAFT_PLACEHOLDER_TOKEN_ID``)."""
        cfg = self.config
        if cfg.method == "draft_model":
            return [DRAFT_PLACEHOLDER_TOKEN_ID] * k
        lo, hi = cfg.prompt_lookup_min or 1, cfg.prompt_lookup_max or 1
        return propose_ngram(request.all_token_ids, lo, hi, k)

    def draft(
        self, request: Request, kv: KVCacheManager, budget: int, num_running: int
    ) -> list[int]:
        """Drafts for a decoding ``request`` with its ``1 + k`` slots allocated (all or
        nothing) and recorded as lookahead; [] (nothing allocated) when it does not
        speculate this step, and the caller schedules its plain decode."""
        # NOTE: before the lookup, which reads all the request's tokens: at or past
        # disable_by_batch_size (ShareGPT-like at 32 in flight) no draft is taken anyway.
        if self.draft_token_cost(num_running) is None:
            return []
        limit = self.limit(request, budget)
        if limit < 1:
            return []
        drafts = self.propose(request, limit)
        if not drafts:
            return []
        drafts = drafts[: self.num_to_draft(request, num_running, len(drafts))]
        if not drafts or kv.allocate_slots(request, 1 + len(drafts)) is None:
            return []
        kv.set_lookahead(request, len(drafts))
        return drafts

    def verified(
        self, request: Request, sr: ScheduledRequest, out: ModelRunnerOutput, kv: KVCacheManager
    ) -> list[int]:
        """Apply the verification of ``sr``'s drafts (``request.num_computed_tokens`` already
        counts all of them): the rejected ones leave the count, their blocks go back to the
        pool, the figures and the request's acceptance are updated. Returns the accepted
        drafts, which the caller appends before the sampled token."""
        k = len(sr.spec_token_ids)
        a = out.spec_num_accepted.get(sr.request_id, 0)
        if not 0 <= a <= k:
            raise ValueError(f"{sr.request_id!r}: {a} of {k} draft tokens accepted")
        drafts = out.spec_token_ids.get(sr.request_id, sr.spec_token_ids)
        if len(drafts) != k:
            raise ValueError(f"{sr.request_id!r}: {len(drafts)} draft tokens reported for {k}")
        request.num_computed_tokens -= k - a
        kv.release_rejected(request, request.num_computed_tokens)
        self.stats.observe(k, a)
        request.spec_accepted = DECAY * request.spec_accepted + a
        request.spec_tested = DECAY * request.spec_tested + a + (a < k)
        return drafts[:a]
