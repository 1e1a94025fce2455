"""Kernel selection: deterministic choice from (fake) timings, the cache and what invalidates
it, failing candidates, ``off``, and every real candidate's numerics vs fp32 ``F.linear``."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.config import DTYPE_CHOICES, KERNEL_SELECTION_MODES, EngineConfig
from kvserve.kernel_setup import DTYPES
from kvserve.runtime import kernel_cache, kernel_select, linear
from kvserve.runtime.kernel_cache import cache_key, cache_path
from kvserve.runtime.kernel_select import (
    SELECTION_MODES,
    choose,
    m_buckets,
    plan_of,
    select_kernels,
)
from kvserve.runtime.linear import (
    M_MAX,
    DenseMmMethod,
    Linear,
    LinearMethod,
    build_linear,
    candidate_methods,
    dense_candidates,
)

CPU = torch.device("cpu")
SHAPES = [(24, 16), (16, 40)]


class FakeMethod(LinearMethod):
    """Correct math (``x @ w.t()``), a name, and a cost the fake timer reads."""

    def __init__(self, weight: torch.Tensor, name: str, *, shares: bool = True) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.name = name
        self.shares_source = shares

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.mm(x, self.weight.t(), out=out)


class RaisingMethod(FakeMethod):
    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        raise RuntimeError("no kernel for this shape")


def fake_factory(source, *, act_dtype, device):  # type: ignore[no-untyped-def]
    return [FakeMethod(source, "small"), FakeMethod(source, "big", shares=False)]


def raising_factory(source, *, act_dtype, device):  # type: ignore[no-untyped-def]
    raise ImportError("library missing")


def broken_method_factory(source, *, act_dtype, device):  # type: ignore[no-untyped-def]
    return [RaisingMethod(source, "broken")]


def fake_timer(calls: list[str] | None = None):  # type: ignore[no-untyped-def]
    """ "small" wins up to M=8, "big" above (by far more than the margin)."""

    def timer(method: LinearMethod, x: torch.Tensor, out: torch.Tensor) -> float:
        if calls is not None:
            calls.append(method.name)
        m = x.shape[0]
        if method.name == "small":
            return 1e-6 * m
        return 1e-5 + 1e-8 * m

    return timer


def _select(tmp_path, **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("act_dtype", torch.float32)
    kw.setdefault("factories", [fake_factory])
    kw.setdefault("timer", fake_timer())
    return select_kernels(SHAPES, directory=tmp_path, **kw)


def test_choice_is_the_fastest_per_bucket_and_deterministic(tmp_path) -> None:
    a = _select(tmp_path, mode="measure")
    b = _select(tmp_path, mode="measure")
    expected = [
        (1, "small"),
        (8, "small"),
        (16, "big"),
        (32, "big"),
        (128, "big"),
        (256, "big"),
        (M_MAX, "big"),
    ]
    assert a.plan == b.plan == {s: expected for s in SHAPES}
    assert a.source == "measured"
    assert "M<=8 small" in a.summary() and "M>=9 big" in a.summary()


def test_a_method_is_neither_timed_nor_chosen_below_its_min_rows(tmp_path) -> None:
    """``min_rows``: "tiles" would win every bucket, but is offered from 9 rows only."""

    def factory(source, *, act_dtype, device):  # type: ignore[no-untyped-def]
        tiles = FakeMethod(source, "tiles")
        tiles.min_rows = 9
        return [FakeMethod(source, "small"), tiles]

    calls: list[tuple[str, int]] = []

    def timer(method: LinearMethod, x: torch.Tensor, out: torch.Tensor) -> float:
        calls.append((method.name, x.shape[0]))
        return 1e-9 if method.name == "tiles" else 1e-6 * x.shape[0]

    sel = _select(tmp_path, mode="measure", factories=[factory], timer=timer)
    want = [(1, "small"), (8, "small"), *((b, "tiles") for b, _ in m_buckets()[2:])]
    assert sel.plan == {s: want for s in SHAPES}
    assert min(rows for name, rows in calls if name == "tiles") == 16
    assert {(t.candidate, t.max_m) for t in sel.timings if t.candidate == "tiles"} == {
        ("tiles", b) for b, _ in m_buckets()[2:]
    }


def test_each_timed_call_reads_another_copy_of_the_weight() -> None:
    """Cold caches: calls rotate through copies (same values and layout, other storage)
    that together hold about ``cold_bytes``; a weight too small to matter gets none."""
    big = torch.randn(512, 64).t()  # [64, 512] view of [512, 64] storage: the model's layout
    small = torch.randn(8, 8)
    seen: dict[tuple[int, int], list[FakeMethod]] = {}

    def timer(method: LinearMethod, x: torch.Tensor, out: torch.Tensor) -> float:
        seen.setdefault(method.weight.shape, []).append(method)  # type: ignore[attr-defined]
        return 1e-6

    kernel_select.measure(
        {(64, 512): big, (8, 8): small},
        act_dtype=torch.float32,
        device=CPU,
        buckets=[(1, 1), (M_MAX, 4)],
        timer=timer,
        factories=[fake_factory],
        cold_bytes=4 * big.nbytes,
    )
    copies = {id(m.weight): m.weight for m in seen[(64, 512)]}
    assert kernel_select.copies_for(big.nbytes, 4 * big.nbytes) == 4
    assert len({w.data_ptr() for w in copies.values()}) == 4  # "small" and "big": 4 each
    assert all(torch.equal(w, big) and w.stride() == big.stride() for w in copies.values())
    assert {id(m.weight) for m in seen[(8, 8)]} == {id(small)}


def test_a_copying_candidate_must_win_by_the_margin() -> None:
    buckets = [(1, 1)]
    t = [
        kernel_select.Timing(4, 4, 1, 1, "mm", 1.00, 64, shares_source=True),
        kernel_select.Timing(4, 4, 1, 1, "packed", 0.97, 64, shares_source=False),
    ]
    assert choose(t, buckets, margin=0.05) == {(4, 4): [(1, "mm")]}
    assert choose(t, buckets, margin=0.0) == {(4, 4): [(1, "packed")]}


def test_second_selection_reads_the_cache_without_measuring(tmp_path) -> None:
    first = _select(tmp_path, mode="auto")
    calls: list[str] = []
    second = _select(tmp_path, mode="auto", timer=fake_timer(calls))
    assert second.source == "cache" and calls == []
    assert second.plan == first.plan
    third = _select(tmp_path, mode="measure", timer=fake_timer(calls))
    assert third.source == "measured" and calls  # measure ignores the cache


@pytest.mark.parametrize(
    "change",
    [
        "dtype",
        "shapes",
        "candidates",
        "threads",
        "torch",
        "cpu_model",
        "cpu_flags",
        "max_rows",
        "native_march",
    ],
)
def test_cache_is_invalidated_when_any_key_part_changes(tmp_path, monkeypatch, change) -> None:
    _select(tmp_path, mode="auto")
    kw: dict = {}
    if change == "dtype":
        kw["act_dtype"] = torch.bfloat16
    elif change == "shapes":
        kw["shapes_extra"] = (8, 8)
    elif change == "candidates":
        kw["factories"] = [fake_factory, broken_method_factory]
    elif change == "threads":
        monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", "0.0.1-other")
    elif change == "cpu_model":
        monkeypatch.setattr(kernel_cache, "_cpuinfo_field", lambda name: f"Other CPU {name}")
    elif change == "cpu_flags":
        monkeypatch.setattr(kernel_cache, "cpu_flags", lambda: "sse2 other_flag")
    elif change == "max_rows":
        kw["max_rows"] = {SHAPES[0]: 8}
    elif change == "native_march":  # another build target than this run's
        other = "x86-64-v2" if os.environ.get("KVSERVE_NATIVE_MARCH") != "x86-64-v2" else "x86-64"
        monkeypatch.setenv("KVSERVE_NATIVE_MARCH", other)
    extra = kw.pop("shapes_extra", None)
    calls: list[str] = []
    shapes = [*SHAPES, extra] if extra else SHAPES
    sel = select_kernels(
        shapes,
        directory=tmp_path,
        mode="auto",
        timer=fake_timer(calls),
        **{"act_dtype": torch.float32, "factories": [fake_factory], **kw},
    )
    assert sel.source == "measured" and calls


def test_corrupt_cache_is_ignored_with_a_warning_and_rebuilt(tmp_path, caplog) -> None:
    _select(tmp_path, mode="auto")
    (path,) = tmp_path.glob("*.json")
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        sel = _select(tmp_path, mode="auto")
    assert sel.source == "measured"
    assert any("corrupt" in r.getMessage() for r in caplog.records)
    assert json.loads(path.read_text())["plan"]  # rewritten whole
    assert _select(tmp_path, mode="auto").source == "cache"


def test_raising_factory_and_candidate_are_skipped_with_their_reason(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        sel = _select(
            tmp_path,
            mode="measure",
            factories=[raising_factory, broken_method_factory, fake_factory],
        )
    assert "library missing" in sel.skipped["raising_factory"]
    assert "no kernel for this shape" in sel.skipped["broken"]
    assert all(name != "broken" for choice in sel.plan.values() for _, name in choice)
    assert {n for c in sel.plan.values() for _, n in c} == {"small", "big"}


def test_off_restores_the_original_path(tmp_path) -> None:
    calls: list[str] = []
    sel = _select(tmp_path, mode="off", timer=fake_timer(calls))
    assert calls == [] and plan_of(sel) is None
    w = torch.randn(24, 16).t()  # [out, in] view of [in, out] storage, as the model holds
    lin = build_linear(w, act_dtype=torch.float32, device=CPU, choice=None)
    assert [type(m) for m in lin.methods()] == [DenseMmMethod]
    assert lin.methods()[0].name == "mkl_fp32"
    x = torch.randn(5, 24)
    assert torch.equal(lin(x), F.linear(x, w))


def test_unknown_modes_and_dtypes_name_the_choices() -> None:
    with pytest.raises(ValueError, match="auto, measure, off"):
        select_kernels(SHAPES, act_dtype=torch.float32, mode="fastest")
    with pytest.raises(ValueError, match="auto, float32, bfloat16, float16"):
        EngineConfig(dtype="fp8")
    with pytest.raises(ValueError, match="auto, measure, off"):
        EngineConfig(kernel_selection="always")
    # the torch-free lists in engine_config match the modules that act on them
    assert KERNEL_SELECTION_MODES == SELECTION_MODES
    assert set(DTYPE_CHOICES) == {"auto", *DTYPES}


def test_linear_dispatches_by_rows_and_adds_bias_for_methods_without_it() -> None:
    w = torch.randn(6, 4)
    bias = torch.randn(6)
    small, big = FakeMethod(w, "small"), FakeMethod(w, "big")
    lin = Linear(w, [(8, small), (M_MAX, big)], bias)
    assert lin.method_for(1) is small and lin.method_for(8) is small
    assert lin.method_for(9) is big and lin.method_for(10_000) is big
    x = torch.randn(3, 4)
    torch.testing.assert_close(lin(x), F.linear(x, w, bias))
    with pytest.raises(ValueError, match="increasing"):
        Linear(w, [(8, small), (8, big)])


def test_build_linear_falls_back_to_mm_when_oneDNN_is_absent(monkeypatch, caplog) -> None:
    monkeypatch.setattr(linear, "onednn_available", lambda: False)
    w = torch.randn(12, 8)
    names = [m.name for m in dense_candidates(w, act_dtype=torch.float32, device=CPU)]
    assert names == ["mkl_fp32"]
    with caplog.at_level(logging.WARNING):
        lin = build_linear(
            w, act_dtype=torch.float32, device=CPU, choice=[(M_MAX, "onednn_prepacked_fp32")]
        )
    assert lin.methods()[0].name == "mkl_fp32"
    assert any("unavailable" in r.getMessage() for r in caplog.records)


def test_key_holds_the_parts_the_issue_names() -> None:
    key = cache_key(
        act_dtype=torch.bfloat16,
        device=CPU,
        shapes=SHAPES,
        buckets=m_buckets(),
        max_rows=None,
        factories=[fake_factory],
    )
    for part in ("cpu", "cpu_flags", "torch", "dtype", "shapes", "candidates", "threads"):
        assert key[part], part
    assert cache_path(key).suffix == ".json"


# ---- every real candidate vs fp32 F.linear ------------------------------------------------

# NOTE: max |error| relative to max |reference|. fp32 candidates differ from F.linear only in
# summation order; bf16 candidates round x and W to bf16 (8 significant bits, 2^-9 relative
# each) and the output too, so a sum of K terms of random sign stays well inside 3e-2.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 600),
    half_n=st.integers(1, 300),
    k=st.integers(1, 700),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_real_candidates_match_fp32_linear(m, half_n, k, dtype, bias, seed) -> None:
    n = 2 * half_n + 1  # odd N
    gen = torch.Generator().manual_seed(seed)
    w32 = torch.randn(k, n, generator=gen).t()  # [n, k], the model's transposed storage
    x32 = torch.randn(m, k, generator=gen)
    b32 = torch.randn(n, generator=gen) if bias else None
    ref = F.linear(x32, w32, b32)  # [m, n]
    w, x = w32.to(dtype), x32.to(dtype)
    b = b32.to(dtype) if b32 is not None else None
    methods = candidate_methods(w, act_dtype=dtype, device=CPU)
    assert methods, "no candidate for a dense weight"
    for method in methods:
        lin = Linear(w, [(M_MAX, method)], b)
        out = torch.empty(m, n, dtype=dtype)
        got = lin(x, out)
        assert got.data_ptr() == out.data_ptr(), method.name
        err = (got.float() - ref).abs().max().item()
        scale = ref.abs().max().item() or 1.0
        assert err <= TOLERANCE[dtype] * scale, (method.name, m, n, k, err, scale)
        assert lin(x).shape == (m, n)  # out=None allocates


def test_a_selection_measured_on_a_busy_machine_is_redone_when_it_is_quiet(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(kernel_select, "machine_load", lambda: 5.0)
    assert _select(tmp_path, mode="auto").load == 5.0
    calls: list[str] = []
    # still busy: the provisional cache is used
    assert _select(tmp_path, mode="auto", timer=fake_timer(calls)).source == "cache"
    monkeypatch.setattr(kernel_select, "machine_load", lambda: 0.3)
    sel = _select(tmp_path, mode="auto", timer=fake_timer(calls))
    assert sel.source == "measured" and calls
    assert _select(tmp_path, mode="auto").source == "cache"  # a quiet measurement sticks


def test_a_copy_held_for_one_bucket_needs_no_margin_in_the_others() -> None:
    buckets = [(1, 1), (8, 8)]
    t = [
        kernel_select.Timing(4, 4, 1, 1, "mm", 1.00, 64, shares_source=True),
        kernel_select.Timing(4, 4, 1, 1, "packed", 0.50, 64, shares_source=False),
        kernel_select.Timing(4, 4, 8, 8, "mm", 1.00, 64, shares_source=True),
        kernel_select.Timing(4, 4, 8, 8, "packed", 0.98, 64, shares_source=False),
    ]
    assert choose(t, buckets, margin=0.05) == {(4, 4): [(1, "packed"), (8, "packed")]}
    # without the decisive bucket, the 2% win is inside the margin
    assert choose(t[2:], buckets[1:], margin=0.05) == {(4, 4): [(8, "mm")]}


def test_a_second_copy_must_beat_the_held_one_by_the_margin() -> None:
    """Two layouts of the same dense copy: the second is held only where it beats the first
    by the margin (each costs the weight's memory again)."""
    buckets = [(1, 1), (8, 8), (32, 32)]

    def timings(b_at_32: float) -> list[kernel_select.Timing]:
        rows = [("kernel", 1.0, 1.0, 1.0, True), ("copy_a", 0.5, 0.5, 0.5, False)]
        rows.append(("copy_b", 0.6, 0.49, b_at_32, False))  # 2 % better than copy_a at M=8
        return [
            kernel_select.Timing(4, 4, m, m, name, secs[i], 64, shares_source=shared)
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


class LazyCopyMethod(FakeMethod):
    """Holds a copy made by ``prepare`` (as the prepacked methods do); ``fail`` makes it raise."""

    fail = False

    def __init__(self, weight: torch.Tensor, name: str) -> None:
        super().__init__(weight, name, shares=False)
        self.prepared = False

    def prepare(self) -> None:
        if self.fail:
            raise RuntimeError("no room for the copy")
        self.prepared = True

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if not self.prepared:  # as the real ones: made on the first call if not before
            self.prepare()
        return super().apply(x, out)


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

    timings = kernel_select.measure(
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

    timings = kernel_select.measure(
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
