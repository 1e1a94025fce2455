"""The scheduler (no torch): token-budget continuous batching on top of the KV manager.

- ``scheduler``: ``Scheduler.schedule()`` / ``update_from_output()``.
- ``step_plan``: a step's budget, chunks and output; ``admission``: validation, queue order,
  seats, headroom, hysteresis; ``preemption``: victim choice, recompute vs swap;
  ``policy``: FCFS and priority; ``stop_checks``: appending a token, stop checks.
- ``step_cost`` / ``step_budget``: an online step-cost model and the step-time budget that
  sizes prefill chunks with it; ``sched_stats``: the scheduler's counters.
"""
