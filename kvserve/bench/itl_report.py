"""Tables of the step-time budget runs (``bench/run_itl.sh``): ITL tail, TTFT, goodput by rate.

Reads ``bench serve`` records (``--output-json``) whose ``label`` names the policy and prints
Markdown: per policy and rate the output tokens/s, ITL median / p99 / max and p99 / median,
TTFT median / p90 / p99 and its coefficient of variation (stdev / mean over the requests'
TTFTs, from the stored samples), and the fraction of requests meeting the SLO; then per
policy the highest rate that still met >= 90 % and the first that did not.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict
from typing import Any

from kvserve.bench.plots import load_records

ATTAINMENT_GOAL = 0.9


def _rate(rec: dict[str, Any]) -> float:
    rate = rec.get("request_rate")
    return float(rate) if isinstance(rate, (int, float)) else math.inf


def ttft_cv(rec: dict[str, Any]) -> float:
    """stdev / mean of the per-request TTFTs kept in the record (NaN with fewer than 2)."""
    values = (rec.get("latency_samples") or {}).get("ttft") or []
    if len(values) < 2:
        return math.nan
    mean = statistics.fmean(values)
    return statistics.stdev(values) / mean if mean > 0 else math.nan


def row(rec: dict[str, Any]) -> list[str]:
    """One table row of a serve record."""
    r = rec["results"]
    itl, ttft = r["itl"], r["ttft"]
    ratio = itl["p99"] / itl["median"] if itl.get("median") else math.nan
    att = r.get("slo_attainment")
    return [
        rec.get("label") or rec.get("system", "?"),
        f"{_rate(rec):g}",
        f"{r['output_tokens_per_s']:.1f}",
        f"{itl['median'] * 1e3:.0f}",
        f"{itl['p99'] * 1e3:.0f}",
        f"{itl['max'] * 1e3:.0f}",
        f"{ratio:.2f}",
        f"{ttft['median'] * 1e3:.0f}",
        f"{ttft['p90'] * 1e3:.0f}",
        f"{ttft['p99'] * 1e3:.0f}",
        f"{ttft_cv(rec):.2f}",
        "-" if att is None or r.get("slo_itl_s") is None else f"{att:.2f}",
    ]


HEADER = [
    "policy",
    "req/s",
    "output tok/s",
    "ITL p50 ms",
    "ITL p99 ms",
    "ITL max ms",
    "ITL p99/p50",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "TTFT p99 ms",
    "TTFT CV",
    "SLO met",
]


def crossings(records: list[dict[str, Any]]) -> list[list[str]]:
    """Per policy: the highest rate meeting the goal and the first rate below it."""
    by_policy: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for rec in records:
        r = rec["results"]
        if r.get("slo_itl_s") is not None and math.isfinite(_rate(rec)):
            by_policy[rec.get("label") or "?"].append((_rate(rec), r["slo_attainment"]))
    out = []
    for policy, points in sorted(by_policy.items()):
        points.sort()
        ok = [rate for rate, a in points if a >= ATTAINMENT_GOAL]
        below = [rate for rate, a in points if a < ATTAINMENT_GOAL]
        out.append(
            [
                policy,
                f"{max(ok):g}" if ok else "none",
                f"{min(below):g}" if below else f"none up to {points[-1][0]:g}",
                " ".join(f"{rate:g}:{a:.2f}" for rate, a in points),
            ]
        )
    return out


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the tables for the records under the given files / folders."""
    p = argparse.ArgumentParser(prog="kvserve bench itl-report", description=__doc__)
    p.add_argument("results", nargs="+", help="bench serve JSON records or folders of them")
    args = p.parse_args(argv)
    records = [r for r in load_records(args.results) if r["benchmark"] == "serve"]
    if not records:
        raise ValueError(f"no bench serve records under {' '.join(args.results)}")
    records.sort(key=lambda r: (r.get("label") or "", _rate(r)))
    print(_table(HEADER, [row(r) for r in records]))
    cross = crossings(records)
    if cross:
        slo = {r["results"].get("slo_itl_s") for r in records} - {None}
        goal = f">= {ATTAINMENT_GOAL:.0%} of requests meet the ITL SLO"
        print(f"\nITL SLO (per request p99 gap) {', '.join(f'{s * 1e3:.0f} ms' for s in slo)}:")
        print(_table(["policy", f"highest rate {goal}", "first rate below", "rate:met"], cross))
    return 0
