"""Kernel selection's flow (``autotune.select.select_kernels``): deterministic choice from
(fake) timings, the cache and what invalidates it, the cache per checkout, failing
candidates, ``off``."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch.nn.functional as F

from kvserve.engine.config import DTYPE_CHOICES, KERNEL_SELECTION_MODES, EngineConfig
from kvserve.runtime.autotune import DTYPES, SELECTION_MODES, candidates, select
from kvserve.runtime.autotune.cache import cache_dir, cache_key, cache_path
from kvserve.runtime.autotune.candidates import build_linear, m_buckets
from kvserve.runtime.autotune.choose import plan_of
from kvserve.runtime.autotune.select import select_kernels
from kvserve.runtime.linear import M_MAX, DenseMmMethod, LinearMethod

from .fakes import (
    CPU,
    SHAPES,
    FakeMethod,
    broken_method_factory,
    fake_factory,
    fake_timer,
    raising_factory,
)


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
        monkeypatch.setattr(candidates, "_cpuinfo_field", lambda name: f"Other CPU {name}")
    elif change == "cpu_flags":
        monkeypatch.setattr(candidates, "cpu_flags", lambda: "sse2 other_flag")
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


def _key(dtype: torch.dtype) -> dict[str, object]:
    return cache_key(
        act_dtype=dtype,
        device=CPU,
        shapes=SHAPES,
        buckets=m_buckets(),
        max_rows=None,
        factories=[fake_factory],
    )


def test_key_holds_the_parts_the_issue_names() -> None:
    key = _key(torch.bfloat16)
    for part in ("cpu", "cpu_flags", "torch", "dtype", "shapes", "candidates", "threads"):
        assert key[part], part
    assert cache_path(key).suffix == ".json"


def test_a_selection_measured_on_a_busy_machine_is_redone_when_it_is_quiet(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(select, "machine_load", lambda: 5.0)
    assert _select(tmp_path, mode="auto").load == 5.0
    calls: list[str] = []
    # still busy: the provisional cache is used
    assert _select(tmp_path, mode="auto", timer=fake_timer(calls)).source == "cache"
    monkeypatch.setattr(select, "machine_load", lambda: 0.3)
    sel = _select(tmp_path, mode="auto", timer=fake_timer(calls))
    assert sel.source == "measured" and calls
    assert _select(tmp_path, mode="auto").source == "cache"  # a quiet measurement sticks


def test_the_cache_is_per_checkout(tmp_path, monkeypatch) -> None:
    """Two package roots (two checkouts) keep their records apart; one root, one place."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    a, b = tmp_path / "a" / "kvserve", tmp_path / "b" / "kvserve"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    assert cache_dir(a) != cache_dir(b)
    assert cache_dir(a) == cache_dir(tmp_path / "a" / "x" / ".." / "kvserve")  # resolved
    assert cache_dir(a).parent == cache_dir(b).parent == tmp_path / "kernel_select"
    key = _key(torch.float32)
    here = cache_path(key)
    assert here.parent == cache_dir() and cache_path(key) == here  # this checkout's
    assert here.parent not in (cache_dir(a), cache_dir(b))
