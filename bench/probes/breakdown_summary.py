"""Summarise ``step_breakdown.py`` outputs: per decode run, the step and its Python overhead.

    PYTHONPATH=. .venv/bin/python bench/probes/breakdown_summary.py LOG

LOG holds ``step_breakdown.py`` outputs, each after a line ``== LABEL ...``. Printed per
decode run (warm-up runs of 3 steps skipped): the step's ms, the attention call's time outside
its two kernels (``write_kv``, ``paged_decode_attention``) and the forward glue.
"""

from __future__ import annotations

import re
import sys


def main() -> None:
    """Parse the log named on the command line and print one line per decode run."""
    runs: list[dict[str, str | float]] = []
    label = "?"
    for line in open(sys.argv[1]):
        if line.startswith("=="):
            label = line.split()[1]
            continue
        m = re.match(r"decode B=(\d+): ([\d.]+) ms a step over (\d+)", line)
        if m:
            runs.append({"label": label, "B": m[1], "step": float(m[2]), "steps": m[3]})
            continue
        m = re.match(r"\s+(.+?)\s{2,}([\d.]+) ms", line)
        if m and runs:
            runs[-1][m[1]] = float(m[2])
    for r in runs:
        if r["steps"] == "3":
            continue
        outside = float(r["attention"]) - float(r["attention: paged_decode_attention"])
        outside -= float(r["attention: write_kv"])
        glue = float(r["forward glue (views, embed, rope tables, adds)"])
        print(
            f"{r['label']:>6} B={r['B']:>2}  step {r['step']:6.2f} ms  attention call outside its "
            f"kernels {outside:.3f} ms  forward glue {glue:.3f} ms"
        )


if __name__ == "__main__":
    main()
