"""`kvserve serve` with every engine step recorded, written as JSON when the server exits.

    PYTHONPATH=. .venv/bin/python bench/probes/serve_trace.py OUT.json serve --port 8150 \\
        --num-threads 2 --quiet --step-budget --ttft-aging 0.25
    # ... send a trace with `kvserve bench serve`, then stop the server (SIGTERM): OUT.json

Each record is the engine's ``step_records`` entry plus ``t0`` / ``t1`` (monotonic seconds at
the step's start and end) and, with the step budget on, its last ``target_ms`` and
``decode_ms`` (the planner's target and its predicted pure-decode step). It gives the time
between steps and which steps stretched a stream's gap (bench/README.md, ITL, session 8).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from kvserve.cli import main
from kvserve.engine import LLMEngine

RECORDS: list[dict[str, Any]] = []


def _traced_step(step: Any) -> Any:
    def traced(self: LLMEngine) -> Any:
        t0 = time.monotonic()
        out = step(self)
        t1 = time.monotonic()
        if self.step_records:
            rec: dict[str, Any] = dict(self.step_records[-1], t0=t0, t1=t1)
            budget = getattr(self.scheduler, "step_budget", None)
            if budget is not None:
                rec["target_ms"] = budget.last_target_s * 1e3
                rec["decode_ms"] = budget.last_decode_s * 1e3
            RECORDS.append(rec)
        return out

    return traced


def run(out_path: str, argv: list[str]) -> int:
    """Serve with ``argv`` (the `kvserve` CLI's), recording steps; dump them on exit."""
    LLMEngine.step = _traced_step(LLMEngine.step)  # type: ignore[method-assign]
    real_exit = os._exit

    def exit_with_dump(code: int) -> None:  # NOTE: `kvserve serve` leaves by os._exit
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(RECORDS, f)
        real_exit(code)

    os._exit = exit_with_dump  # type: ignore[assignment]
    return main(argv)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], sys.argv[2:]))
