"""The step check (``kvserve.runtime.autotune.check``): which plans it tries, what a pass runs,
the margin for copies, failures keeping the per-shape choice, and its place in the cache."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
import torch

from kvserve.runtime.autotune import check
from kvserve.runtime.autotune.candidates import m_buckets
from kvserve.runtime.autotune.check import alternatives, check_plan
from kvserve.runtime.autotune.choose import Selection
from kvserve.runtime.autotune.measure import Timing
from kvserve.runtime.autotune.select import select_kernels
from kvserve.runtime.linear import M_MAX, LinearMethod

from .fakes import FakeMethod

CPU = torch.device("cpu")
QKV, DOWN = (24, 16), (16, 40)
COUNTS = {QKV: 3, DOWN: 3}


def factory(source, *, act_dtype, device):  # type: ignore[no-untyped-def]
    """ "a" reads the weight, "b" and "c" hold copies."""
    return [
        FakeMethod(source, "a"),
        FakeMethod(source, "b", shares=False),
        FakeMethod(source, "c", shares=False),
    ]


def sources() -> dict[tuple[int, int], torch.Tensor]:
    return {s: torch.randn(s) for s in COUNTS}


def per_shape(at32: dict[str, float]) -> list[Timing]:
    """Timings where "a" wins every bucket by far, except at 32 rows: ``at32`` there."""
    out = []
    for s in COUNTS:
        for max_m, probe in m_buckets():
            times = at32 if max_m == 32 else {"a": 1.0, "b": 9.0, "c": 9.0}
            for n, t in times.items():
                out.append(Timing(*s, max_m, probe, n, t, 64, shares_source=n == "a"))
    return out


def plan_all(name: str) -> dict[tuple[int, int], list[tuple[int, str]]]:
    return {s: [(b, name) for b, _ in m_buckets()] for s in COUNTS}


def pass_timer(cost: dict[str, float], seen: list[list[tuple[LinearMethod, int]]] | None = None):  # type: ignore[no-untyped-def]
    """A pass costs the sum of its calls' ``cost[name]``; each pass's calls go to ``seen``."""

    def timer(calls: Sequence[tuple[LinearMethod, torch.Tensor, torch.Tensor]]) -> float:
        if seen is not None:
            seen.append([(m, x.shape[0]) for m, x, _ in calls])
        return sum(cost[m.name] for m, _, _ in calls)

    return timer


def run(plan, timings, cost, seen=None, **kw):  # type: ignore[no-untyped-def]
    """``check_plan`` on the fake layers with a pass costing ``cost`` per call by name."""
    kw.setdefault("factories", [factory])
    timer = kw.pop("timer", None) or pass_timer(cost, seen)
    return check_plan(
        sources(), COUNTS, plan, timings, act_dtype=torch.float32, device=CPU, timer=timer, **kw
    )


def test_alternatives_are_the_base_then_one_plan_per_near_candidate() -> None:
    seconds = {QKV: {"a": 1.0, "b": 1.2, "c": 2.0}, DOWN: {"a": 1.0, "c": 1.1, "b": 1.5}}
    base = {QKV: "a", DOWN: "a"}
    assert alternatives(seconds, base, 0.25) == [
        {QKV: "a", DOWN: "a"},
        {QKV: "b", DOWN: "a"},
        {QKV: "a", DOWN: "c"},
    ]
    assert alternatives(seconds, base, 0.6) == [
        {QKV: "a", DOWN: "a"},
        {QKV: "b", DOWN: "b"},
        {QKV: "a", DOWN: "c"},
    ]
    assert alternatives(seconds, base, 0.0) == [base]


def test_a_plan_faster_on_whole_steps_replaces_the_per_shape_choice() -> None:
    """Per shape "a" wins at 32 rows, "b" is within the tolerance; on step passes "b" runs
    20 % faster: bucket 32 takes "b" for both shapes, every other bucket keeps "a"."""
    seen: list[list[tuple[LinearMethod, int]]] = []
    near = per_shape({"a": 1.0, "b": 1.1, "c": 5.0})
    new, checks = run(plan_all("a"), near, {"a": 1.0, "b": 0.8, "c": 0.1}, seen)
    want = {s: [(b, "b" if b == 32 else "a") for b, _ in m_buckets()] for s in COUNTS}
    assert new == want
    assert [c.max_m for c in checks] == [32] and checks[0].rows == 32 and checks[0].chosen == 1
    assert [[n for *_, n in plan] for plan, _ in checks[0].plans] == [["a", "a"], ["b", "b"]]
    assert [s for _, s in checks[0].plans] == [6.0, pytest.approx(4.8)]
    # "c" (5x the fastest per shape) is never run; a pass makes the step's 6 calls, layer
    # by layer, each layer's call on its own copy of the weight.
    assert {m.name for p in seen for m, _ in p} == {"a", "b"}
    assert all(len(p) == 6 and {r for _, r in p} == {32} for p in seen)
    first_b = next(p for p in seen if p[0][0].name == "b")
    assert [m.out_features for m, _ in first_b] == [24, 16, 24, 16, 24, 16]
    assert len({id(m.weight) for m, _ in first_b}) == 6  # type: ignore[attr-defined]


def test_a_copying_plan_must_win_the_step_by_the_margin() -> None:
    cost = {"a": 1.0, "b": 0.97, "c": 1.0}
    new, checks = run(plan_all("a"), per_shape({"a": 1.0, "b": 1.1, "c": 5.0}), cost)
    assert new == plan_all("a") and checks[0].chosen == 0
    # The per-shape plan too: holding copies ("b" at 32 rows), 3 % is not enough.
    plan_b = {s: [(b, "b" if b == 32 else "a") for b, _ in m_buckets()] for s in COUNTS}
    new, checks = run(plan_b, per_shape({"a": 1.1, "b": 1.0, "c": 5.0}), cost)
    assert new == plan_all("a")
    assert checks[0].chosen == 1 and [n for *_, n in checks[0].plans[1][0]] == ["a", "a"]
    # A copy that the 9-16 bucket holds anyway costs nothing more: no margin then.
    plan = {s: [(b, "b" if b == 16 else "a") for b, _ in m_buckets()] for s in COUNTS}
    # (no timings at 16 rows: that bucket is not checked)
    timings = [t for t in per_shape({"a": 1.0, "b": 1.1, "c": 5.0}) if t.max_m != 16]
    new, checks = run(plan, timings, cost)
    assert [c.max_m for c in checks] == [32] and checks[0].chosen == 1
    assert new == {s: [(b, "b" if b in (16, 32) else "a") for b, _ in m_buckets()] for s in COUNTS}


class DoubleMethod(FakeMethod):
    """A copy twice the weight's bytes."""

    @property
    def nbytes(self) -> int:
        return 2 * super().nbytes


def wide_factory(source, *, act_dtype, device):  # type: ignore[no-untyped-def]
    return [
        *factory(source, act_dtype=act_dtype, device=device)[:2],
        DoubleMethod(source, "c", shares=False),
    ]


def step_bytes(per_weight: int) -> int:
    """The bytes of every layer's weights, ``per_weight`` copies of each beside the source."""
    return sum(n * (1 + per_weight) * s[0] * s[1] * 4 for s, n in COUNTS.items())


def test_past_the_stream_bytes_the_largest_alternative_is_not_tried() -> None:
    """ "b" and "c" near; the sources, "b"'s copies and "c"'s (twice as large) pass the bytes
    allowed: the plan with "c" is dropped and the rest run on every layer's own copy."""
    seen: list[list[tuple[LinearMethod, int]]] = []
    near = per_shape({"a": 1.0, "b": 1.1, "c": 1.2})
    cost = {"a": 1.0, "b": 0.9, "c": 0.1}
    new, checks = run(
        plan_all("a"), near, cost, seen, factories=[wide_factory], stream_bytes=step_bytes(1)
    )
    assert [[n for *_, n in plan] for plan, _ in checks[0].plans] == [["a", "a"], ["b", "b"]]
    assert {m.name for p in seen for m, _ in p} == {"a", "b"}
    assert len({id(m.weight) for p in seen for m, _ in p}) == 6  # type: ignore[attr-defined]
    assert new[QKV][3] == (32, "b")


def test_when_the_chosen_plan_alone_passes_the_bytes_calls_rotate_through_fewer_copies() -> None:
    seen: list[list[tuple[LinearMethod, int]]] = []
    near = per_shape({"a": 1.1, "b": 1.0, "c": 5.0})
    cost = {"a": 1.0, "b": 0.8, "c": 0.1}
    run(plan_all("b"), near, cost, seen, stream_bytes=step_bytes(1) // 3)
    assert {m.name for p in seen for m, _ in p} == {"a", "b"}
    assert all(len(p) == 6 for p in seen)  # the step's calls, on one copy a shape
    assert len({id(m.weight) for p in seen for m, _ in p}) == 2  # type: ignore[attr-defined]


def test_nothing_near_or_a_failing_pass_keeps_the_choice(caplog) -> None:
    seen: list[list[tuple[LinearMethod, int]]] = []
    far = per_shape({"a": 1.0, "b": 2.0, "c": 5.0})
    assert run(plan_all("a"), far, {}, seen) == (plan_all("a"), [])
    assert seen == []

    def broken(calls):  # type: ignore[no-untyped-def]
        raise RuntimeError("kernel fault")

    near = per_shape({"a": 1.0, "b": 1.1, "c": 5.0})
    assert run(plan_all("a"), near, {}, timer=broken) == (plan_all("a"), [])
    assert "step check at 32 rows skipped: RuntimeError: kernel fault" in caplog.text


def test_select_kernels_checks_steps_when_given_counts_and_caches_the_checks(
    tmp_path, monkeypatch
) -> None:
    """With ``counts`` the per-shape choice goes through the check (its records in the cache
    and in the Selection read back); without, no check and another cache file."""

    def timer(method: LinearMethod, x: torch.Tensor, out: torch.Tensor) -> float:
        return {"a": 1.0, "b": 1.1, "c": 5.0}[method.name] * 1e-6

    monkeypatch.setattr(check, "_wall_pass", pass_timer({"a": 1.0, "b": 0.5, "c": 1.0}))
    kw = dict(act_dtype=torch.float32, factories=[factory], timer=timer, directory=tmp_path)
    plain = select_kernels(list(COUNTS), mode="measure", **kw)
    assert plain.checks == [] and plain.plan == plan_all("a")
    checked = select_kernels(list(COUNTS), mode="measure", counts=COUNTS, **kw)
    # "b" runs every step faster; each decode bucket checked takes it, the rest keep "a".
    want = {s: [(b, "b" if b <= 32 else "a") for b, _ in m_buckets()] for s in COUNTS}
    assert checked.plan == want
    assert [c["max_m"] for c in checked.checks] == [1, 8, 16, 32]
    cached = select_kernels(list(COUNTS), mode="auto", counts=COUNTS, **kw)
    assert cached.source == "cache" and cached.plan == want and cached.checks == checked.checks
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 2
    keys = [json.loads(f.read_text())["key"]["step_counts"] for f in files]
    assert sorted(keys, key=str) == sorted([None, [[16, 40, 3], [24, 16, 3]]], key=str)
    assert M_MAX in {b for b, _ in checked.plan[QKV]}


def test_bench_kernels_prints_each_plan_tried_and_marks_the_one_taken() -> None:
    from kvserve.bench.kernels import check_lines

    sel = Selection(torch.bfloat16, {})
    sel.checks = [
        {"max_m": 32, "rows": 32, "plans": [[[[24, 16, "a"]], 0.002], [[[24, 16, "b"]], 0.001]],
         "chosen": 1}
    ]  # fmt: skip
    lines = check_lines(sel, {QKV: "qkv"})
    assert len(lines) == 2
    assert "(32 rows)" in lines[0] and "2.000 ms  qkv a" in lines[0] and "*" not in lines[0]
    assert lines[1].endswith("1.000 ms  qkv b  *")


def test_a_copy_a_later_bucket_takes_is_free_for_an_earlier_one() -> None:
    """At 16 rows "b" (a copy) runs 3 % faster, under the margin; at 32 rows 20 % faster,
    so 32 takes it, and on the second pass over the buckets 16 takes it too (free now)."""
    timings = []
    for s in COUNTS:
        for max_m, probe in m_buckets():
            near = max_m in (16, 32)
            times = {"a": 1.0, "b": 1.1 if near else 9.0, "c": 9.0}
            for n, t in times.items():
                timings.append(Timing(*s, max_m, probe, n, t, 64, shares_source=n == "a"))

    def timer(calls: Sequence[tuple[LinearMethod, torch.Tensor, torch.Tensor]]) -> float:
        rows = calls[0][1].shape[0]
        b = 0.97 if rows == 16 else 0.8
        return sum(b if m.name == "b" else 1.0 for m, _, _ in calls)

    new, checks = run(plan_all("a"), timings, {}, timer=timer)
    assert [(c.max_m, c.chosen) for c in checks] == [(16, 1), (32, 1)]
    assert new == {s: [(b, "b" if b in (16, 32) else "a") for b, _ in m_buckets()] for s in COUNTS}


def test_a_plan_reading_more_bytes_must_win_by_the_margin_even_when_its_copies_are_free() -> None:
    """ "c" reads twice the weight's bytes; its copies are held anyway (the 9-16 bucket took
    it): 3 % faster on passes is not enough, 10 % is."""
    plan = {s: [(b, "c" if b == 16 else "a") for b, _ in m_buckets()] for s in COUNTS}
    timings = [t for t in per_shape({"a": 1.0, "b": 5.0, "c": 1.1}) if t.max_m != 16]
    kw = {"factories": [wide_factory]}
    new, _ = run(plan, timings, {"a": 1.0, "b": 1.0, "c": 0.97}, **kw)
    assert new == plan
    new, _ = run(plan, timings, {"a": 1.0, "b": 1.0, "c": 0.9}, **kw)
    assert new == {s: [(b, "c" if b in (16, 32) else "a") for b, _ in m_buckets()] for s in COUNTS}
