"""Step-time budget: size each step's prefill chunks so the step's predicted time fits a target.

What a running stream feels is step time, not a token count: a step with 512 prefill tokens
beside the decodes costs several decode steps, chunked or not. So, after the scheduler has
given every running decode its token, :meth:`StepTimeBudget.plan` hands the prefill
candidates (running prompts still prefilling, swapped ones, the waiting queue) chunk caps
such that the step's predicted time stays within the target:

- target: ``max_step_ms``; else ``target_itl_ms`` minus the measured time between steps
  (what a stream's gap holds besides the step itself); else ``decode_multiple`` x the
  predicted pure-decode step at the current batch (decodes and context of this step).
- predictions come from an :class:`~kvserve.core.sched.step_cost.OnlineStepCostModel` fitted on the
  engine's step records (``observe``); until it has a fit, nothing is capped.
- the token budget stays an upper bound (the scheduler applies both).
- decodes are never capped (they are scheduled before the plan); a step without decodes is
  not capped either: a lone prefill takes the whole token budget (no stream to protect).
- if nothing fits (the decodes alone exceed the target, or leave less than one token), the
  first candidate still gets ``min_prefill_chunk`` tokens, so prefill never starves; a target
  below the pure-decode step is logged once as a warning.

The target binds only where it buys something (the TTFT guard; issue 21 measured a fixed
target raising TTFT p90 9x at low load, where the token budget alone already kept the tail):

- few streams: with fewer than ``min_decodes`` decodes in the step, nothing is capped (the
  stall falls on one or two streams, the cost of splitting on every waiting prompt).
- aging: a prompt still waiting for its first token that has waited ``w`` seconds (since
  arrival) may stretch the step to ``target + ttft_aging x w``, ``w`` bounded by the wait of
  any prompt the step completes before it (issue 51: a short request arriving beside an old
  long prompt is not made to wait for the long one's stretched step). The stall the streams
  are asked to take grows with the time the prompt has already lost: with ``ttft_aging=1``
  each step's allowance is at least the time waited so far, so the allowed chunk about
  doubles step after step and a split prompt is done within a few steps, while a step with
  no old prompt keeps the plain target. ``ttft_aging=0`` is the fixed target.
- deadline (``ttft_slack``): a prompt that has waited ``ttft_slack`` x the predicted time of
  the step that would compute it unsplit (beside this step's decodes) is not capped at all
  (its wait bounded as for aging, by that of a prompt the step completes before it).
  TTFT is then within about that multiple of the unsplit prefill plus one step, and under
  overload (long queues: every wait past its deadline) the planner stands aside, because
  there small chunks cost throughput (every step pays the weight reads) and the queue grows.
  With ``deadline_multiple``, past the deadline the step may stretch to that multiple of the
  pure-decode step instead (issue 51: uncapped late prompts were the arrivals' p99 ITL).

The ITL tail allowance (``tail_fraction``) spends the percentile an ITL objective leaves:
a p99 objective lets 1 % of a stream's gaps be slow, and splitting a prompt always delays
it. So a step that the target would cut may instead run uncapped (the token budget alone)
when the allowance covers the decodes it stalls. The allowance is a bucket of decode tokens:
every executed decode adds ``tail_fraction`` of a token (``observe``), up to
``tail_fraction x tail_window``; an uncapped step spends one token per decode it carries. It
starts empty, so the decodes stalled this way never exceed ``tail_fraction`` of the decodes
executed (the cap keeps an idle hour from banking a burst). Only prompts of at least
``tail_min_tokens`` remaining tokens can spend it: a short prompt split costs a step or two,
a long one many, and long prompts are what sets the TTFT tail. Host noise also lands in the
percentile, so the fraction must leave room for it.

Who gets the time (``prefill_policy``), greedily in this order, each candidate the largest
chunk that still fits:

- ``fcfs``: the scheduler's order (running prefills by priority and arrival, swapped, then the
  waiting queue): one long prompt takes every step's time until it is done.
- ``shortest``: fewest remaining tokens first (shortest-remaining-processing-time), so short
  prompts are not held behind a long one.
- ``round-robin``: least recently served first (never served = first), so every waiting
  prompt gets a chunk in turn.

Waiting requests are admitted head of line only, so whatever the policy, the positions it
gives to waiting requests are filled in queue order.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvserve.core.sched.ahead import remaining_tokens
from kvserve.core.sched.step_cost import OnlineStepCostModel, StepLoad
from kvserve.request import Request

logger = logging.getLogger("kvserve")

PREFILL_POLICIES = ("fcfs", "shortest", "round-robin")
_GAP_EWMA = 0.1  # weight of the newest inter-step gap in its moving average


def _positive_ms(name: str, value: float | None) -> None:
    if value is None:
        return
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} ({flag}) must be a number of milliseconds > 0, got {value!r}")
    if math.isinf(value) or math.isnan(value):
        raise ValueError(f"{name} ({flag}) must be finite, got {value!r}")


@dataclass(frozen=True)
class StepBudgetConfig:
    """How the step-time budget picks its target and shares it. ValueError names the flag."""

    max_step_ms: float | None = None
    target_itl_ms: float | None = None
    decode_multiple: float = 1.75
    prefill_policy: str = "shortest"
    min_prefill_chunk: int = 16
    window: int = 256  # step records kept per kind for the fit
    refit_every: int = 16
    min_records: int = 4  # of each kind (pure decode, with prefill) before anything is capped
    skip_first: int = 2  # the first steps pay one-off costs (allocator, kernel selection)
    ttft_aging: float = 1.0  # step-time extension per second a prompt has waited (0: none)
    min_decodes: int = 1  # fewer decodes than this in a step: no cap (1: always cap)
    ttft_slack: float | None = None  # deadline: waited >= slack x unsplit step -> no cap
    tail_fraction: float | None = None  # ITL tail allowance: share of decodes a step may stall
    tail_window: int = 2000  # decode tokens the allowance is counted over (bucket size / share)
    tail_min_tokens: int = 64  # remaining prompt tokens that may spend the allowance
    deadline_multiple: float | None = None  # past the deadline: cap x decode step (None: none)

    def __post_init__(self) -> None:
        _positive_ms("max_step_ms", self.max_step_ms)
        _positive_ms("target_itl_ms", self.target_itl_ms)
        if self.max_step_ms is not None and self.target_itl_ms is not None:
            raise ValueError(
                "set one of max_step_ms (--max-step-ms) and target_itl_ms "
                "(--target-itl-ms), not both"
            )
        m = self.decode_multiple
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 1.0 <= m < math.inf:
            raise ValueError(
                f"step_decode_multiple (--step-decode-multiple) must be a number >= 1, got {m!r}"
            )
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(
                f"prefill_policy (--prefill-policy) must be one of {', '.join(PREFILL_POLICIES)}, "
                f"got {self.prefill_policy!r}"
            )
        if self.min_prefill_chunk < 1:
            raise ValueError(f"min_prefill_chunk must be >= 1, got {self.min_prefill_chunk}")
        if self.skip_first < 0:
            raise ValueError(f"skip_first must be >= 0, got {self.skip_first}")
        a = self.ttft_aging
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a < math.inf:
            raise ValueError(f"ttft_aging (--ttft-aging) must be a number >= 0, got {a!r}")
        sl = self.ttft_slack
        if sl is not None and (
            isinstance(sl, bool) or not isinstance(sl, (int, float)) or not 0.0 <= sl < math.inf
        ):
            raise ValueError(f"ttft_slack (--ttft-slack) must be a number >= 0, got {sl!r}")
        dm = self.deadline_multiple
        if dm is not None and (
            isinstance(dm, bool) or not isinstance(dm, (int, float)) or not 1.0 <= dm < math.inf
        ):
            raise ValueError(f"deadline_multiple (--step-deadline-multiple) must be >= 1: {dm!r}")
        tf = self.tail_fraction
        if tf is not None and (
            isinstance(tf, bool) or not isinstance(tf, (int, float)) or not 0.0 < tf < 1.0
        ):
            raise ValueError(
                f"tail_fraction (--step-tail-fraction) must be a number in (0, 1), got {tf!r}"
            )
        for name, flag in (("tail_window", ""), ("tail_min_tokens", " (--step-tail-min-tokens)")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}{flag} must be an int >= 1, got {v!r}")
        if isinstance(self.min_decodes, bool) or not isinstance(self.min_decodes, int):
            raise ValueError(
                f"min_decodes (--step-min-decodes) must be an int, got {self.min_decodes!r}"
            )
        if self.min_decodes < 1:
            raise ValueError(
                f"min_decodes (--step-min-decodes) must be >= 1, got {self.min_decodes}"
            )


class StepCostPredictor(Protocol):
    """What the planner needs of a cost model (the online fit, or a fake in tests)."""

    @property
    def ready(self) -> bool: ...

    def predict(self, load: StepLoad) -> float: ...

    def observe(self, load: StepLoad, seconds: float) -> None: ...


@dataclass(slots=True, frozen=True)
class PrefillCandidate:
    """A request that could get a prefill chunk this step."""

    request_id: str
    start_pos: int  # tokens already computed (waiting: 0; prefix hits are not known yet)
    remaining: int  # tokens left to compute
    waiting: bool = False  # in the waiting queue: admitted head of line only
    waited_s: float = 0.0  # since arrival, while no token was produced yet (else 0): aging


def prefill_candidates(
    started: Iterable[Request],
    waiting: Iterable[Request],
    scheduled_ids: Container[str],
    free_seats: int,
    now: float,
) -> list[PrefillCandidate]:
    """The step's prefill candidates in FCFS order: ``started`` requests (running, then
    swapped) with more than one token left and nothing scheduled yet, then ``waiting`` ones
    while ``free_seats`` last (a request takes one seat per sample). A prompt's wait since
    arrival ages its TTFT guard until its first token."""
    out = []
    for r in started:
        remaining = remaining_tokens(r)
        if remaining > 1 and r.request_id not in scheduled_ids:
            wait = 0.0 if r.output_token_ids else now - r.arrival_time
            out.append(
                PrefillCandidate(r.request_id, r.num_computed_tokens, remaining, waited_s=wait)
            )
    for r in waiting:
        free_seats -= 1 + len(r.pending_children)
        if free_seats < 0:
            break
        wait = 0.0 if r.output_token_ids else now - r.arrival_time
        out.append(PrefillCandidate(r.request_id, 0, r.num_tokens, True, wait))
    return out


class StepTimeBudget:
    """Plans prefill chunk caps per step (see the module docstring); fed with step records."""

    def __init__(
        self,
        config: StepBudgetConfig | None = None,
        cost_model: StepCostPredictor | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or StepBudgetConfig()
        cfg = self.config
        self.cost: StepCostPredictor = cost_model or OnlineStepCostModel(
            window=cfg.window, refit_every=cfg.refit_every, min_records=cfg.min_records
        )
        self.clock = clock
        self._last_served: dict[str, int] = {}  # round-robin: plan number of the last chunk
        self._num_plans = 0
        self._num_seen = 0
        self._last_observe: tuple[float, bool] | None = None  # (clock, step had decodes)
        self.gap_s = 0.0  # moving average of the time between a step's end and the next one's
        self._warned = False
        self._tail_fraction = cfg.tail_fraction or 0.0
        self.tail_capacity = self._tail_fraction * cfg.tail_window  # decode tokens it can hold
        self.tail_credit = 0.0  # earned by executed decodes (observe)
        # Figures (stats()).
        self.last_target_s = math.nan
        self.last_decode_s = math.nan
        self.num_capped_steps = 0  # steps whose prefill was cut below the token budget
        self.num_min_chunk_steps = 0  # steps where nothing fit and a minimum chunk went
        self.num_over_target_steps = 0  # of those, where the decodes alone exceeded the target
        self.num_aged_steps = 0  # steps given more than the target for a prompt's waiting time
        self.num_few_decode_steps = 0  # steps left uncapped: fewer than min_decodes decodes
        self.num_tail_steps = 0  # steps left uncapped on the ITL tail allowance

    # ------------------------------------------------------------------ records in

    def observe(self, record: Mapping[str, float]) -> None:
        """Feed one ``LLMEngine.step_records`` entry (its ``seconds`` and its step's load)."""
        now = self.clock()
        load = StepLoad.from_record(record)
        seconds = float(record["seconds"])
        has_decodes = load.num_decode_tokens > 0
        last = self._last_observe
        if last is not None and last[1] and has_decodes:
            # NOTE: only between two busy steps: an idle engine waits for arrivals, which is
            # no part of any stream's gap.
            gap = max(0.0, (now - last[0]) - seconds)
            self.gap_s += _GAP_EWMA * (gap - self.gap_s)
        self._last_observe = (now, has_decodes)
        if self.tail_capacity:
            earned = self._tail_fraction * load.num_decode_tokens
            self.tail_credit = min(self.tail_capacity, self.tail_credit + earned)
        self._num_seen += 1
        if self._num_seen > self.config.skip_first:
            self.cost.observe(load, seconds)

    # ------------------------------------------------------------------ planning

    def target_s(self, decode_s: float) -> float:
        """The step-time target in seconds, given the predicted pure-decode step."""
        cfg = self.config
        if cfg.max_step_ms is not None:
            return cfg.max_step_ms / 1e3
        if cfg.target_itl_ms is not None:
            return max(cfg.target_itl_ms / 1e3 - self.gap_s, 0.0)
        return cfg.decode_multiple * decode_s

    def plan(
        self,
        decode_contexts: Sequence[int],
        candidates: Sequence[PrefillCandidate],
        token_budget: int,
    ) -> dict[str, int] | None:
        """Chunk caps (tokens) per candidate id for this step; None = no cap this step.

        ``decode_contexts``: start_pos + 1 of each decode already scheduled this step.
        ``candidates``: in the scheduler's (FCFS) order. ``token_budget``: tokens left in the
        step's token budget (an upper bound for the sum of the caps).
        """
        if not candidates or not decode_contexts or not self.cost.ready or token_budget <= 0:
            return None
        cfg = self.config
        if len(decode_contexts) < cfg.min_decodes:
            self.num_few_decode_steps += 1
            return None
        self._num_plans += 1
        load = StepLoad.decodes(decode_contexts)
        decode_s = self.cost.predict(load)
        target = self.target_s(decode_s)
        self.last_decode_s, self.last_target_s = decode_s, target
        order = self._order(candidates)
        decodes_only = load
        caps = {c.request_id: 0 for c in candidates}
        left = token_budget
        granted = 0
        aged = False
        fresh = math.inf  # least wait of a prompt this step completes (bounds the aging)
        for c in order:
            limit = min(c.remaining, left)
            if limit <= 0:
                break
            waited = min(max(c.waited_s, 0.0), fresh)
            own = target + cfg.ttft_aging * waited
            if cfg.ttft_slack is not None and waited > 0.0:
                unsplit = self.cost.predict(decodes_only.plus_chunk(c.start_pos, limit))
                if waited >= cfg.ttft_slack * unsplit:  # past its TTFT deadline
                    dm = cfg.deadline_multiple
                    own = math.inf if dm is None else max(own, dm * decode_s)
            n = self._largest_fit(load, c.start_pos, limit, own)
            if n == 0:
                continue
            aged = aged or self.cost.predict(load.plus_chunk(c.start_pos, n)) > target
            caps[c.request_id] = n
            if n == c.remaining and (c.waiting or c.waited_s > 0.0):
                # NOTE: its first token ends this step: stretch it no more than it waited.
                fresh = min(fresh, max(c.waited_s, 0.0))
            load = load.plus_chunk(c.start_pos, n)
            left -= n
            granted += n
        wanted = min(sum(c.remaining for c in candidates), token_budget)
        capped = granted < wanted
        if capped and self._spend_tail(len(decode_contexts), candidates, caps):
            return None
        if granted == 0:
            # NOTE: the policy's first gets a minimum chunk (a short prompt is not held behind a
            # long one), and so does a running prefill: a waiting head may not be admitted.
            running = next((c for c in order if not c.waiting), order[0])
            left = token_budget
            for c in {order[0].request_id: order[0], running.request_id: running}.values():
                caps[c.request_id] = n = min(cfg.min_prefill_chunk, c.remaining, left)
                left -= n
            self.num_min_chunk_steps += 1
            if decode_s >= target:
                self.num_over_target_steps += 1
                self._warn_below_decode(decode_s, target, len(decode_contexts))
        for c in candidates:
            if caps[c.request_id]:
                self._last_served[c.request_id] = self._num_plans
        if len(self._last_served) > 4 * len(candidates) + 64:
            ids = {c.request_id for c in candidates}
            self._last_served = {k: v for k, v in self._last_served.items() if k in ids}
        self.num_aged_steps += aged
        self.num_capped_steps += sum(caps.values()) < wanted
        return caps

    def _spend_tail(
        self, num_decodes: int, candidates: Sequence[PrefillCandidate], caps: Mapping[str, int]
    ) -> bool:
        """Take the ITL tail allowance for an uncapped step if it covers the stalled decodes.

        Only for a long prompt the caps cut: one with ``tail_min_tokens`` or more remaining.
        """
        if self.tail_credit < num_decodes:
            return False
        long = self.config.tail_min_tokens
        if not any(c.remaining >= long and caps[c.request_id] < c.remaining for c in candidates):
            return False
        self.tail_credit -= num_decodes
        self.num_tail_steps += 1
        return True

    def _largest_fit(self, load: StepLoad, start: int, limit: int, target: float) -> int:
        """Largest n in [0, limit] with predict(load + chunk(start, n)) <= target (bisection)."""
        predict = self.cost.predict
        target *= 1.0 + 1e-9  # NOTE: float rounding must not cost a token at an exact fit
        if predict(load.plus_chunk(start, 1)) > target:
            return 0
        if predict(load.plus_chunk(start, limit)) <= target:
            return limit
        lo, hi = 1, limit  # fits at lo, not at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if predict(load.plus_chunk(start, mid)) <= target:
                lo = mid
            else:
                hi = mid
        return lo

    def _order(self, candidates: Sequence[PrefillCandidate]) -> list[PrefillCandidate]:
        policy = self.config.prefill_policy
        if policy == "fcfs":
            return list(candidates)
        if policy == "shortest":
            ranked = sorted(candidates, key=lambda c: c.remaining)
        else:  # round-robin: least recently served first, never served first of all
            ranked = sorted(candidates, key=lambda c: self._last_served.get(c.request_id, -1))
        # Waiting requests keep their queue order in the slots the policy gave them.
        queue = iter([c for c in candidates if c.waiting])
        return [next(queue) if c.waiting else c for c in ranked]

    def _warn_below_decode(self, decode_s: float, target: float, num_decodes: int) -> None:
        if self._warned:
            return
        self._warned = True
        logger.warning(
            "step-time target %.1f ms is below the predicted pure-decode step (%.1f ms at %d "
            "decodes): decodes alone exceed it; prefill advances by %d tokens a step "
            "(min_prefill_chunk) while this lasts",
            target * 1e3,
            decode_s * 1e3,
            num_decodes,
            self.config.min_prefill_chunk,
        )

    # ------------------------------------------------------------------ figures

    def stats(self) -> dict[str, float | int]:
        """Figures for ``stats()``: the last target, the fit, how often it capped."""
        d: dict[str, float | int] = {
            "step_budget_target_ms": self.last_target_s * 1e3,
            "step_budget_decode_ms": self.last_decode_s * 1e3,
            "step_budget_capped_steps": self.num_capped_steps,
            "step_budget_min_chunk_steps": self.num_min_chunk_steps,
            "step_budget_over_target_steps": self.num_over_target_steps,
            "step_budget_gap_ms": self.gap_s * 1e3,
            "step_budget_aged_steps": self.num_aged_steps,
            "step_budget_few_decode_steps": self.num_few_decode_steps,
            "step_budget_tail_steps": self.num_tail_steps,
            "step_budget_tail_credit": self.tail_credit,
        }
        describe = getattr(self.cost, "describe", None)
        if callable(describe):
            d.update(describe())
        return d
