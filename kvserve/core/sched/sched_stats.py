"""Scheduler figures: cumulative counters and the record of the last step.

Names follow DESIGN.md's figures table (``preemptions``, ``max_concurrent_requests``, ...).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class StepStats:
    """What one ``Scheduler.schedule()`` call did (read back as ``Scheduler.last_step``)."""

    step: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_scheduled_requests: int = 0
    num_scheduled_tokens: int = 0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0  # tokens a victim computed, discarded by recompute preemption
    num_free_blocks: int = 0
    kv_usage: float = 0.0
    schedule_time_s: float = 0.0  # perf_counter time spent in schedule()


@dataclass(slots=True)
class SchedulerStats:
    """Counters over the scheduler's whole life."""

    num_steps: int = 0
    num_steps_with_preemption: int = 0
    num_scheduled_requests: int = 0  # ScheduledRequest entries emitted (request-steps)
    num_scheduled_tokens: int = 0
    preemptions: int = 0
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    swap_fallbacks_to_recompute: int = 0  # swap wanted but the host tier was full
    priority_preemptions: int = 0  # of preemptions: for a more important waiting request
    recomputed_tokens_wasted: int = 0  # tokens computed, then discarded by recompute preemption
    max_concurrent_requests: int = 0  # peak number of RUNNING requests
    num_finished_requests: int = 0
    num_aborted_requests: int = 0
    schedule_time_s: float = 0.0  # total perf_counter time spent in schedule()

    def record_step(self, step: StepStats) -> None:
        """Fold one step's record into the totals."""
        self.num_steps += 1
        self.num_steps_with_preemption += step.num_preemptions > 0
        self.num_scheduled_requests += step.num_scheduled_requests
        self.num_scheduled_tokens += step.num_scheduled_tokens
        self.max_concurrent_requests = max(self.max_concurrent_requests, step.num_running)
        self.schedule_time_s += step.schedule_time_s

    def as_dict(self) -> dict[str, float | int]:
        """All counters plus derived rates, by their figure names."""
        d: dict[str, float | int] = asdict(self)
        d["preemptions_per_1k_scheduled"] = (
            1000.0 * self.preemptions / self.num_scheduled_requests
            if self.num_scheduled_requests
            else 0.0
        )
        d["preempted_step_fraction"] = (
            self.num_steps_with_preemption / self.num_steps if self.num_steps else 0.0
        )
        d["schedule_time_per_step_s"] = (
            self.schedule_time_s / self.num_steps if self.num_steps else 0.0
        )
        return d
