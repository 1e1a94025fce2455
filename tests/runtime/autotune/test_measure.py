"""Measure and choose: each timed call on another copy, copies made first, slow candidates
sitting out; the choice per bucket and the margin a copy must win by."""

from __future__ import annotations

import torch

from kvserve.runtime.autotune.choose import choose
from kvserve.runtime.autotune.measure import Timing, copies_for, measure
from kvserve.runtime.linear import M_MAX, LinearMethod

from .fakes import CPU, FakeMethod, LazyCopyMethod, fake_factory


def test_each_timed_call_reads_another_copy_of_the_weight() -> None:
    """Cold caches: calls rotate through copies (same values and layout, other storage)
    that together hold about ``cold_bytes``; a weight too small to matter gets none."""
    big = torch.randn(512, 64).t()  # [64, 512] view of [512, 64] storage: the model's layout
    small = torch.randn(8, 8)
    seen: dict[tuple[int, int], list[FakeMethod]] = {}

    def timer(method: LinearMethod, x: torch.Tensor, out: torch.Tensor) -> float:
        seen.setdefault(method.weight.shape, []).append(method)  # type: ignore[attr-defined]
        return 1e-6

    measure(
        {(64, 512): big, (8, 8): small},
        act_dtype=torch.float32,
        device=CPU,
        buckets=[(1, 1), (M_MAX, 4)],
        timer=timer,
        factories=[fake_factory],
        cold_bytes=4 * big.nbytes,
    )
    copies = {id(m.weight): m.weight for m in seen[(64, 512)]}
    assert copies_for(big.nbytes, 4 * big.nbytes) == 4
    assert len({w.data_ptr() for w in copies.values()}) == 4  # "small" and "big": 4 each
    assert all(torch.equal(w, big) and w.stride() == big.stride() for w in copies.values())
    assert {id(m.weight) for m in seen[(8, 8)]} == {id(small)}


def test_copies_are_made_before_any_timed_call() -> None:
    """A candidate's copies are prepared up front, so no timed call pays for making one; one
    whose copy cannot be made is reported failed and the others are still timed."""
    big = torch.randn(512, 64).t()
    timed: list[tuple[str, bool]] = []

    def factory(source, *, act_dtype, device):  # type: ignore[no-untyped-def]
        broken = LazyCopyMethod(source, "broken")
        broken.fail = True
        return [FakeMethod(source, "mm"), LazyCopyMethod(source, "packed"), broken]

    def timer(method: LinearMethod, x: torch.Tensor, out: torch.Tensor) -> float:
        timed.append((method.name, getattr(method, "prepared", True)))
        return 1e-6

    timings = measure(
        {(64, 512): big},
        act_dtype=torch.float32,
        device=CPU,
        buckets=[(1, 1)],
        timer=timer,
        factories=[factory],
        cold_bytes=4 * big.nbytes,
    )
    assert {n for n, _ in timed} == {"mm", "packed"}
    assert all(prepared for _, prepared in timed)
    failed = [t for t in timings if t.seconds is None]
    assert [(t.candidate, t.error) for t in failed] == [
        ("broken", "RuntimeError: no room for the copy")
    ]


def test_a_candidate_far_behind_sits_out_the_rest_of_a_cell() -> None:
    """After its first ``min_calls`` calls in a pass, a candidate more than ``SITS_OUT`` times
    the fastest stops being timed there; the fastest goes on to its budget; one within the
    bound keeps running beside it."""
    calls: dict[str, int] = {}

    def factory(source, *, act_dtype, device):  # type: ignore[no-untyped-def]
        return [FakeMethod(source, n) for n in ("fast", "near", "slow")]

    cost = {"fast": 1e-4, "near": 1.5e-4, "slow": 1e-3}

    def timer(method: LinearMethod, x: torch.Tensor, out: torch.Tensor) -> float:
        calls[method.name] = calls.get(method.name, 0) + 1
        return cost[method.name]

    timings = measure(
        {(8, 8): torch.randn(8, 8)},
        act_dtype=torch.float32,
        device=CPU,
        buckets=[(1, 1)],
        timer=timer,
        factories=[factory],
        budget_s=0.00955,
        min_calls=5,
        passes=2,
    )
    assert calls == {"fast": 192, "near": 192, "slow": 10}  # 96 rounds a pass for 9.55 ms
    assert {t.candidate: t.seconds for t in timings} == cost


def test_a_copying_candidate_must_win_by_the_margin() -> None:
    buckets = [(1, 1)]
    t = [
        Timing(4, 4, 1, 1, "mm", 1.00, 64, shares_source=True),
        Timing(4, 4, 1, 1, "packed", 0.97, 64, shares_source=False),
    ]
    assert choose(t, buckets, margin=0.05) == {(4, 4): [(1, "mm")]}
    assert choose(t, buckets, margin=0.0) == {(4, 4): [(1, "packed")]}


def test_a_copy_held_for_one_bucket_needs_no_margin_in_the_others() -> None:
    buckets = [(1, 1), (8, 8)]
    t = [
        Timing(4, 4, 1, 1, "mm", 1.00, 64, shares_source=True),
        Timing(4, 4, 1, 1, "packed", 0.50, 64, shares_source=False),
        Timing(4, 4, 8, 8, "mm", 1.00, 64, shares_source=True),
        Timing(4, 4, 8, 8, "packed", 0.98, 64, shares_source=False),
    ]
    assert choose(t, buckets, margin=0.05) == {(4, 4): [(1, "packed"), (8, "packed")]}
    # without the decisive bucket, the 2% win is inside the margin
    assert choose(t[2:], buckets[1:], margin=0.05) == {(4, 4): [(8, "mm")]}


def test_a_second_copy_must_beat_the_held_one_by_the_margin() -> None:
    """Two layouts of the same dense copy: the second is held only where it beats the first
    by the margin (each costs the weight's memory again)."""
    buckets = [(1, 1), (8, 8), (32, 32)]

    def timings(b_at_32: float) -> list[Timing]:
        rows = [("kernel", 1.0, 1.0, 1.0, True), ("copy_a", 0.5, 0.5, 0.5, False)]
        rows.append(("copy_b", 0.6, 0.49, b_at_32, False))  # 2 % better than copy_a at M=8
        return [
            Timing(4, 4, m, m, name, secs[i], 64, shares_source=shared)
            for i, (m, _) in enumerate(buckets)
            for name, *secs, shared in rows
        ]

    assert choose(timings(0.49), buckets, margin=0.05) == {
        (4, 4): [(1, "copy_a"), (8, "copy_a"), (32, "copy_a")]
    }
    # 20 % better at M=32: worth a second copy, which is then free at M=8 too
    assert choose(timings(0.40), buckets, margin=0.05) == {
        (4, 4): [(1, "copy_a"), (8, "copy_b"), (32, "copy_b")]
    }
