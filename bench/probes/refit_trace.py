"""Refit the step cost model offline on a step trace, with and without the per-chunk term.

    PYTHONPATH=. .venv/bin/python bench/probes/refit_trace.py TRACE.json

TRACE.json: ``LLMEngine.step_records`` entries (``bench/probes/serve_trace.py`` writes them).
Fits on the first half's latest 256 steps of each kind (as the online model keeps them),
then prints the relative error (predicted - actual) / actual of the second half's steps with
prefill: median, 10th and 90th percentiles.
"""

from __future__ import annotations

import json
import sys

from kvserve.core import step_cost
from kvserve.core.step_cost import StepLoad


def errors(records: list[dict], num_features: int) -> list[float]:
    """Sorted relative errors of prefill steps of the second half, fitted on the first."""
    rows = [(StepLoad.from_record(r).features()[:num_features], r["seconds"]) for r in records]
    half = len(rows) // 2
    decode = [r for r in rows[:half] if r[0][2] == 0][-256:]
    prefill = [r for r in rows[:half] if r[0][2] > 0][-256:]
    saved = step_cost.NUM_FEATURES
    step_cost.NUM_FEATURES = num_features  # NOTE: the solver sizes its system from it
    try:
        coef = step_cost._nonneg_relative_lsq(decode + prefill)
    finally:
        step_cost.NUM_FEATURES = saved
    out = []
    for x, y in rows[half:]:
        if x[2] > 0:
            out.append((sum(c * v for c, v in zip(coef, x, strict=True)) - y) / y)
    return sorted(out)


def main() -> None:
    records = json.load(open(sys.argv[1], encoding="utf-8"))[3:]  # skip the first steps
    for label, n in (("without the chunk term", 5), ("with the chunk term", 6)):
        e = errors(records, n)
        k = len(e)
        print(
            f"{label}: prefill steps {k}, relative error median {e[k // 2]:+.3f}, "
            f"p10 {e[k // 10]:+.3f}, p90 {e[9 * k // 10]:+.3f}"
        )


if __name__ == "__main__":
    main()
