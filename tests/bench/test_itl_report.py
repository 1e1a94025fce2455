"""``kvserve bench itl-report``: the tables of bench/run_itl.sh from serve records."""

from __future__ import annotations

import pytest

from kvserve.bench.itl_report import crossings, main, ttft_cv
from kvserve.bench.report import make_record, write_json


def _summary(median: float, p99: float) -> dict:
    return {"mean": median, "median": median, "p90": p99, "p99": p99, "max": p99, "count": 9}


def _record(label: str, rate: float, attainment: float, ttfts: list[float]) -> dict:
    results = {
        "output_tokens_per_s": 100.0 * rate,
        "itl": _summary(0.05, 0.12),
        "ttft": _summary(0.3, 0.9),
        "slo_itl_s": 0.1,
        "slo_attainment": attainment,
    }
    return make_record(
        "serve", results, request_rate=rate, label=label, latency_samples={"ttft": ttfts}
    )


def test_crossing_rate_per_policy_and_the_tables(tmp_path, capsys) -> None:
    recs = [
        _record("budget", 1.0, 1.0, [0.2, 0.4]),
        _record("budget", 2.0, 0.95, [0.2, 0.4]),
        _record("budget", 3.0, 0.5, [0.2, 0.4]),
        _record("baseline", 1.0, 0.85, [0.1, 0.5]),
        _record("baseline", 2.0, 0.2, [0.1, 0.5]),
    ]
    assert crossings(recs) == [
        ["baseline", "none", "1", "1:0.85 2:0.20"],
        ["budget", "2", "3", "1:1.00 2:0.95 3:0.50"],
    ]
    assert ttft_cv(recs[0]) == pytest.approx(0.1414 / 0.3, rel=1e-3)
    for i, r in enumerate(recs):
        write_json(str(tmp_path / f"r{i}.json"), r)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| budget | 2 | 200.0 | 50 | 120 | 120 | 2.40 | 300 | 900 | 900 | 0.47 | 0.95 |" in out
    assert "ITL SLO (per request p99 gap) 100 ms" in out
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no bench serve records"):
        main([str(tmp_path / "empty")])
