"""The entry point (``autotune.choose_kernels``) and ``--dtype auto``: bf16 only with native
bf16 *and* a faster measurement; the warning for an explicit bf16 without native support;
the ops object and its fallback."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from kvserve.config import ModelArchConfig
from kvserve.engine.config import EngineConfig
from kvserve.models.quant_select import projections_for
from kvserve.runtime import layer_ops as layer_ops_mod
from kvserve.runtime.autotune import TuneSettings, choose_kernels, measure_dtype, tune
from kvserve.runtime.autotune.candidates import projection_shapes
from kvserve.runtime.autotune.choose import Selection
from kvserve.runtime.autotune.measure import Timing
from kvserve.runtime.layer_ops import NATIVE_OPS, TORCH_OPS, layer_ops
from kvserve.runtime.linear import M_MAX

ARCH = ModelArchConfig(
    architecture="llama",
    max_position_embeddings=128,
    vocab_size=64,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=4,
)


def _selection(dtype: torch.dtype, seconds: float, mode: str) -> Selection:
    """Every shape x bucket at ``seconds`` with one method "k"."""
    if mode == "off":
        return Selection(dtype, {}, source="off")
    bounds = (1, 8, 32, 128, M_MAX)
    plan, timings = {}, []
    for o, i in projection_shapes(ARCH):
        plan[(o, i)] = [(b, "k") for b in bounds]
        timings += [Timing(o, i, b, min(b, 512), "k", seconds, o * i * 4) for b in bounds]
    return Selection(dtype, plan, timings)


@pytest.fixture
def fake_select(monkeypatch):  # type: ignore[no-untyped-def]
    """Measured matmul seconds per dtype, settable by the test; records the calls."""
    costs = {torch.float32: 2.0, torch.bfloat16: 1.0}
    calls: list[tuple[torch.dtype, str]] = []

    def select(config, arch, dtype, mode, quantized=(), **kw):  # type: ignore[no-untyped-def]
        calls.append((dtype, mode))
        return _selection(dtype, costs[dtype], mode)

    monkeypatch.setattr(tune, "select_shapes", select)
    monkeypatch.setattr(
        tune,
        "dtype_speedup",
        lambda arch, fp32, bf16, **kw: costs[torch.float32] / costs[torch.bfloat16],
    )
    return costs, calls


def test_projection_shapes_count_the_layers_and_the_lm_head() -> None:
    shapes = projection_shapes(ARCH)
    assert shapes == {(32, 16): 2, (16, 16): 2, (48, 16): 2, (16, 24): 2, (64, 16): 1}


@pytest.mark.parametrize(
    ("native", "bf16_cost", "expected"),
    [
        (True, 1.0, torch.bfloat16),  # native and faster
        (True, 3.0, torch.float32),  # native but measured slower
        (False, 1.0, torch.float32),  # no native bf16: never auto-chosen
    ],
)
def test_auto_dtype(monkeypatch, fake_select, native, bf16_cost, expected) -> None:
    costs, _ = fake_select
    costs[torch.bfloat16] = bf16_cost
    monkeypatch.setattr(tune, "native_bf16", lambda: native)
    choice = choose_kernels(TuneSettings(dtype="auto"), ARCH)
    assert choice.dtype == expected
    assert choice.selection.dtype == expected
    assert choice.dtype_name in choice.short() and "auto" in choice.short()


def test_auto_with_selection_off_still_decides_by_measurement(monkeypatch, fake_select) -> None:
    _, calls = fake_select
    monkeypatch.setattr(tune, "native_bf16", lambda: True)
    choice = choose_kernels(TuneSettings(dtype="auto", mode="off"), ARCH)
    assert choice.dtype == torch.bfloat16
    assert choice.selection.source == "off"  # the kernels stay on the original path
    assert (torch.bfloat16, "off") in calls


def test_explicit_bf16_without_native_support_warns_with_the_slowdown(
    monkeypatch, fake_select, caplog
) -> None:
    costs, _ = fake_select
    costs[torch.bfloat16] = 6.0  # 3x the fp32 time
    monkeypatch.setattr(tune, "native_bf16", lambda: False)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        choice = choose_kernels(TuneSettings(dtype="bfloat16"), ARCH)
    assert choice.dtype == torch.bfloat16  # it still runs
    assert any("3.00x" in r.getMessage() for r in caplog.records), caplog.records


def test_explicit_float32_measures_only_float32(monkeypatch, fake_select) -> None:
    _, calls = fake_select
    monkeypatch.setattr(tune, "native_bf16", lambda: True)
    choice = choose_kernels(TuneSettings(dtype="float32"), ARCH)
    assert choice.dtype == torch.float32 and calls == [(torch.float32, "auto")]


def test_layer_ops_fall_back_to_torch_where_native_is_absent(monkeypatch) -> None:
    assert layer_ops(native_kernels=False, device=torch.device("cpu")) is TORCH_OPS
    monkeypatch.setattr(layer_ops_mod.native, "available", lambda: False)
    monkeypatch.setattr(layer_ops_mod.native, "reason", lambda: "no compiler")
    with pytest.raises(ValueError, match="no compiler"):
        layer_ops(native_kernels=True, device=torch.device("cpu"))


def test_native_ops_are_not_used_off_cpu(monkeypatch) -> None:
    monkeypatch.setattr(layer_ops_mod.native, "available", lambda: True)
    assert layer_ops(native_kernels=True, device=torch.device("meta")) is TORCH_OPS
    assert layer_ops(native_kernels=True, device=torch.device("cpu")) is NATIVE_OPS


def test_dtype_speedup_times_both_dtypes_together_and_is_cached(
    tmp_path, monkeypatch, caplog
) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    calls: list[torch.dtype] = []
    attention: list[tuple[torch.dtype, int]] = []

    def timer(lin, x, out):  # type: ignore[no-untyped-def]
        calls.append(x.dtype)
        return 1e-6 if x.dtype == torch.bfloat16 else 3e-6

    def attention_timer(dtype: torch.dtype, batch: int) -> float:
        attention.append((dtype, batch))
        return 1e-6 if dtype == torch.bfloat16 else 3e-6

    fp32 = Selection(torch.float32, {}, source="off")
    bf16 = Selection(torch.bfloat16, {}, source="off")
    cpu = torch.device("cpu")
    kw = {"device": cpu, "timer": timer, "attention_timer": attention_timer}
    speedup = measure_dtype.dtype_speedup(ARCH, fp32, bf16, **kw)
    assert speedup == pytest.approx(3.0)
    assert calls[:2] == [torch.float32, torch.bfloat16]  # alternating
    assert attention[:2] == [(torch.float32, 1), (torch.bfloat16, 1)]
    assert {b for _, b in attention} == {1, 8, 32}
    n = len(calls)
    assert measure_dtype.dtype_speedup(ARCH, fp32, bf16, **kw) == speedup
    assert len(calls) == n  # from the cache
    (path,) = tmp_path.rglob("dtype_*.json")
    path.write_text("garbage")
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        again = measure_dtype.dtype_speedup(ARCH, fp32, bf16, **kw)
    assert again == pytest.approx(3.0) and len(calls) > n
    assert any("corrupt" in r.getMessage() for r in caplog.records)


def test_dtype_speedup_counts_attention_once_per_layer(tmp_path, monkeypatch) -> None:
    """Matmuls at parity, attention 2x faster in bf16: the layers' attention decides."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    fp32 = Selection(torch.float32, {}, source="off")
    bf16 = Selection(torch.bfloat16, {}, source="off")
    matmul = 1e-6  # per call, either dtype: sum over shapes x counts x 3 buckets
    attn = {torch.float32: 4e-6, torch.bfloat16: 2e-6}
    speedup = measure_dtype.dtype_speedup(
        ARCH,
        fp32,
        bf16,
        device=torch.device("cpu"),
        timer=lambda lin, x, out: matmul,
        attention_timer=lambda dtype, batch: attn[dtype],
    )
    matmuls = 3 * matmul * sum(projection_shapes(ARCH).values())
    layers = ARCH.num_hidden_layers
    expected = (matmuls + 3 * layers * attn[torch.float32]) / (
        matmuls + 3 * layers * attn[torch.bfloat16]
    )
    assert speedup == pytest.approx(expected)


def test_quantized_shapes_are_timed_as_they_run(tmp_path, monkeypatch) -> None:
    """A shape given as quantized runs a weight of its format and layout through the
    quantized kernels in both dtypes; the cache key tells the formats apart."""
    from kvserve.models.quant import QuantizedWeight
    from kvserve.runtime import native
    from kvserve.runtime.native import quant_ops

    native.load()  # NOTE: before the cache moves: the kernels are built (or found) where they are
    if not quant_ops.load():
        pytest.skip(f"quantized kernels unavailable: {quant_ops.reason()}")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    arch = dataclasses.replace(ARCH, hidden_size=32, intermediate_size=64, head_dim=8)
    gate_up = (128, 32)
    sources: dict[tuple[int, int], set[str]] = {}

    def timer(lin, x, out):  # type: ignore[no-untyped-def]
        what = lin.source.qtype if isinstance(lin.source, QuantizedWeight) else "dense"
        sources.setdefault(lin.source.shape, set()).add(f"{what} {x.dtype}")
        return 1e-6

    fp32 = Selection(torch.float32, {}, source="off")
    bf16 = Selection(torch.bfloat16, {}, source="off")
    kw = {"device": torch.device("cpu"), "timer": timer, "attention_timer": lambda d, b: 1e-6}
    quantized = projections_for({gate_up: ("q8_0", "plain")}, {gate_up: 2})
    measure_dtype.dtype_speedup(arch, fp32, bf16, quantized=quantized, **kw)
    assert sources[gate_up] == {"q8_0 torch.float32", "q8_0 torch.bfloat16"}
    assert sources[(32, 64)] == {"dense torch.float32", "dense torch.bfloat16"}
    measure_dtype.dtype_speedup(arch, fp32, bf16, **kw)  # dense: another cache entry
    assert len(list(tmp_path.rglob("dtype_*.json"))) == 2


def test_a_model_loaded_quantized_is_weighed_once_on_its_quantized_projections(
    monkeypatch, fake_select
) -> None:
    """The embedded GGUF holds quantized projections: phase 0 measures nothing, loading weighs
    the model's quantized ones (in float32, cast after), and the engine runs that decision."""
    from kvserve.engine.llm_engine import LLMEngine

    monkeypatch.setattr(tune, "native_bf16", lambda: True)
    seen: list[object] = []

    def speedup(arch, fp32, bf16, *, quantized=None, **kw):  # type: ignore[no-untyped-def]
        seen.append(dict(quantized.formats) if quantized is not None else {})
        return 2.0 if quantized else 0.5  # dense: fp32 faster; quantized: bf16 faster

    monkeypatch.setattr(tune, "dtype_speedup", speedup)
    # NOTE: the quantized projections' own kernel timings are not what this test checks
    # (test_quantized.py does): measured for real, the probe times every quantized shape in
    # emulated bf16 on a CPU without it, 8 minutes on a 2-core Zen 3.
    real_quantized = tune.quantized_selection
    monkeypatch.setattr(
        tune, "quantized_selection", lambda q, **kw: real_quantized(q, **{**kw, "mode": "off"})
    )
    # NOTE: small step limits: on a CPU without native bf16 every bf16 GEMM the start-up runs
    # (scratch measurement, row-bucket warm-up) is emulated, minutes at the default 512 rows.
    engine = LLMEngine(
        dtype="auto", kernel_selection="off", num_kv_blocks=16, max_num_batched_tokens=32,
        max_num_seqs=2, max_model_len=128,
    )  # fmt: skip
    assert len(seen) == 1, seen  # the model's formats, nothing dense before the load
    assert {q for q, _ in seen[0].values()} >= {"q4_1", "q8_0"}  # type: ignore[union-attr]
    assert engine.kernels.dtype == torch.bfloat16 and engine.config.dtype == "bfloat16"
    assert "quantized" in engine.kernels.reason and engine.kernels.pending is None
    assert engine.runner.model.norm.dtype == torch.bfloat16


def test_phase_zero_waits_for_the_weights_only_when_they_load_quantized() -> None:
    from kvserve.engine.startup import choose_kernels

    auto = choose_kernels(EngineConfig(dtype="auto", kernel_selection="off"))
    assert auto.pending == "auto" and auto.dtype == torch.float32  # cast once decided
    bf16 = choose_kernels(EngineConfig(dtype="bfloat16", kernel_selection="off"))
    assert bf16.pending == "bfloat16" and bf16.dtype == torch.bfloat16
    dense = choose_kernels(
        EngineConfig(dtype="float32", kernel_selection="off", quantization="none")
    )
    assert dense.pending is None and dense.selection.source == "off"


def test_the_dense_selection_skips_quantized_shapes(monkeypatch) -> None:
    """Only the shapes that stay dense are measured; the choice holds the quantized
    projections' own selection beside them."""
    measured: list[list[tuple[int, int]]] = []

    def select_kernels(shapes, **kw):  # type: ignore[no-untyped-def]
        measured.append(sorted(shapes))
        assert sorted(kw["counts"]) == sorted(shapes)
        return _selection(kw["act_dtype"], 1.0, "auto")

    quant_plan = {(48, 16): [(M_MAX, "q8_0_kernel")]}
    monkeypatch.setattr(tune, "select_kernels", select_kernels)
    monkeypatch.setattr(
        tune,
        "quantized_selection",
        lambda quantized, **kw: Selection(kw["act_dtype"], quant_plan, source="cache"),
    )
    settings = TuneSettings(dtype="float32")
    steps = projection_shapes(ARCH)
    one = projections_for({(48, 16): ("q8_0", "x16")}, steps)
    choice = choose_kernels(settings, ARCH, one)
    assert measured == [sorted(s for s in projection_shapes(ARCH) if s != (48, 16))]
    assert choice.selection.plan[(48, 16)] == [(M_MAX, "q8_0_kernel")]
    assert choice.selection.plan[(16, 16)] == [(b, "k") for b in (1, 8, 32, 128, M_MAX)]
    every = {s: ("q8_0", "x16") for s in projection_shapes(ARCH)}
    measured.clear()
    choice = choose_kernels(settings, ARCH, projections_for(every, steps))
    assert measured == [] and choice.selection.plan == quant_plan


def test_the_engine_runs_the_quantized_selection_it_chose_with_once(monkeypatch) -> None:
    """The choice made at load holds the quantized projections' plan: the engine runs it,
    with the model's own step counts, and does not select them a second time."""
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.models import quant_select

    calls: list[dict[tuple[int, int], int] | None] = []

    def quantized_selection(quantized, **kw):  # type: ignore[no-untyped-def]
        calls.append(quantized.counts)
        plan = {s: [(M_MAX, f"{q}_kernel")] for s, (q, _) in quantized.formats.items()}
        return Selection(kw["act_dtype"], plan, source="cache")

    monkeypatch.setattr(tune, "quantized_selection", quantized_selection)
    engine = LLMEngine(dtype="float32", num_kv_blocks=16)
    model = engine.runner.model
    assert calls == [quant_select.quantized_counts(model)]
    formats = quant_select.quantized_formats(model)
    assert formats and all(
        model.linear_plan[s] == [(M_MAX, f"{q}_kernel")] for s, (q, _) in formats.items()
    )
