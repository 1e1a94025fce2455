"""The default step-time budget: it caps only while its own cost model holds on this machine.

Issue 51: the step-time budget (``step_budget.StepTimeBudget``, issue 21) bounds the stall a
prefill chunk puts on running streams and on a short request arriving beside a long prompt,
but it was off by default because on a noisy host its predictions, and so its caps, did not
hold. :class:`MeasuredStepBudget` is the budget the engine builds when neither
``--step-budget`` nor ``--no-step-budget`` is given. Its rule is measured by the engine as it
runs, never a constant tuned on one CPU:

- the target is a multiple (``decode_multiple``) of the predicted pure-decode step at the
  step's batch, from the cost model fitted online on the engine's own step records;
- before each record of a step with decodes is fed to the fit, the step is predicted from
  the fit so far and the relative error ``|predicted - measured| / measured`` is kept (the
  latest ``window``);
- while the median of those errors is above ``max_error`` (or fewer than ``min_checked``
  steps were checked), the budget stands aside for the step (``plan`` returns None) and the
  scheduler's fair prefill share sizes the chunks, as with ``--no-step-budget``.

So on a machine where the step time follows the load (the cost model's premise) the chunks
are sized by time; where host noise swamps it, the token budget and the fair share decide.
The scheduler treats it as any ``StepTimeBudget``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from kvserve.core.sched.step_budget import (
    PrefillCandidate,
    StepBudgetConfig,
    StepCostPredictor,
    StepTimeBudget,
)
from kvserve.core.sched.step_cost import StepLoad

DEFAULT_MAX_ERROR = 0.5  # median relative prediction error under which the fit holds
DEFAULT_FIT_WINDOW = 64  # checked steps the median is taken over
DEFAULT_MIN_CHECKED = 8  # checked steps before the fit can hold


class MeasuredStepBudget(StepTimeBudget):
    """A :class:`StepTimeBudget` that plans only while its fit predicts the steps (module doc)."""

    def __init__(
        self,
        config: StepBudgetConfig | None = None,
        cost_model: StepCostPredictor | None = None,
        *,
        max_error: float = DEFAULT_MAX_ERROR,
        window: int = DEFAULT_FIT_WINDOW,
        min_checked: int = DEFAULT_MIN_CHECKED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 < max_error < math.inf:
            raise ValueError(f"max_error must be a number > 0, got {max_error!r}")
        if not 1 <= min_checked <= window:
            raise ValueError(f"min_checked must be in [1, window={window}], got {min_checked}")
        super().__init__(config, cost_model, clock=clock)
        self.max_error = max_error
        self.min_checked = min_checked
        self.errors: deque[float] = deque(maxlen=window)
        self.num_unheld_plans = 0  # steps left to the fair share: the fit did not hold

    @property
    def fit_error(self) -> float:
        """Median relative prediction error of the latest checked steps (nan: none yet)."""
        return statistics.median(self.errors) if self.errors else math.nan

    @property
    def holds(self) -> bool:
        """True while enough steps were checked and their median error is within bounds."""
        return len(self.errors) >= self.min_checked and self.fit_error <= self.max_error

    def observe(self, record: Mapping[str, float]) -> None:
        """Check the fit's prediction of this step, then feed it (``StepTimeBudget.observe``)."""
        seconds = float(record["seconds"])
        load = StepLoad.from_record(record)
        # NOTE: only steps with decodes: the only ones the budget caps, and a lone prefill
        # of a few tokens is mostly host jitter.
        if self.cost.ready and load.num_decode_tokens > 0 and 0.0 < seconds < math.inf:
            self.errors.append(abs(self.cost.predict(load) - seconds) / seconds)
        super().observe(record)

    def plan(
        self,
        decode_contexts: Sequence[int],
        candidates: Sequence[PrefillCandidate],
        token_budget: int,
    ) -> dict[str, int] | None:
        """``StepTimeBudget.plan`` while the fit holds; else None (the fair share's step)."""
        if candidates and decode_contexts and not self.holds:
            self.num_unheld_plans += 1
            return None
        return super().plan(decode_contexts, candidates, token_budget)

    def stats(self) -> dict[str, float | int]:
        """``StepTimeBudget.stats`` plus the fit check's figures."""
        d = super().stats()
        d.update(
            step_budget_fit_error=self.fit_error,
            step_budget_fit_holds=int(self.holds),
            step_budget_unheld_steps=self.num_unheld_plans,
        )
        return d
