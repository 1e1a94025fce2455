"""The soak's request plan: both passes send the same requests except the faulted ones."""

from __future__ import annotations

from kvserve.bench.soak import MODES, _p99, _plan, build_parser


def test_passes_differ_only_in_faulted_requests() -> None:
    base = _plan(2000, 0.05, 7, "m", faults=False)
    soak = _plan(2000, 0.05, 7, "m", faults=True)
    differ = [i for i, (b, s) in enumerate(zip(base, soak, strict=True)) if b != s]
    assert all(soak[i][0] in ("fault", "fuzz") for i in differ)
    assert all(kind in MODES for kind, _ in base)
    assert 60 <= len(differ) <= 140  # ~5 % of 2000
    kinds = {kind for kind, _ in soak}
    assert {"fault", "fuzz", "stream", "plain", "chat", "n", "cancel"} <= kinds
    faults = [body for kind, body in soak if kind == "fault"]
    assert all("KVSERVE_INJECT_FAULT" in body["prompt"] for body in faults)


def test_p99_and_defaults() -> None:
    assert _p99([float(i) for i in range(1, 101)]) == 100.0
    assert _p99([]) == 0.0
    args = build_parser().parse_args([])
    assert args.num_requests == 2000 and args.fault_fraction == 0.05
    assert args.drain_tokens == 4000 and args.shutdown_timeout == 30.0
