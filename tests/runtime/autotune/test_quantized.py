"""The quantized projections' selection (``autotune.select.quantized_selection``, through
``models.quant_select``): the kernel or a dense copy per bucket, and its cache keyed by the
block format and layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.runtime.native import quant_ops
from tests.runtime.test_quant_model import assert_close_to_twin, build, kernel_name, logits
from tests.tiny_gguf import make_tiny_gguf


@pytest.mark.skipif(not quant_ops.load(), reason="quantized kernels unavailable")
def test_selection_per_bucket_between_kernel_and_dense_copy(tmp_path: Path) -> None:
    from kvserve.models.quant_select import quantized_shapes, select_quantized_kernels
    from kvserve.runtime.autotune.candidates import m_buckets

    path = make_tiny_gguf(tmp_path, "smollm", tensor_type="Q4_1")
    model = build(path, "auto")
    shapes = quantized_shapes(model)
    assert shapes[(model.arch.vocab_size, model.arch.hidden_size)] == "q4_1"
    plan = select_quantized_kernels(
        model, act_dtype=torch.float32, budget_s=0.001, directory=tmp_path / "cache"
    )
    assert plan.keys() == shapes.keys()
    kernel = kernel_name("q4_1")
    for choice in plan.values():
        assert [b for b, _ in choice] == [b for b, _ in m_buckets()]
        assert {name for _, name in choice} <= {
            kernel,
            "dequant_tile_fp32",
            "dequant_fp32",
            "dequant_onednn_fp32",
        }
    model.set_linear_plan(plan)
    assert_close_to_twin(logits(model), logits(build(path, "none")))
    assert select_quantized_kernels(model, act_dtype=torch.float32, mode="off") == {}


@pytest.mark.skipif(not quant_ops.load(), reason="quantized kernels unavailable")
def test_quantized_selection_is_cached_by_format_and_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvserve.models import quant_select
    from kvserve.models.quant_linear import LAYOUT_ENV
    from kvserve.runtime.autotune import select

    path = make_tiny_gguf(tmp_path, "smollm", tensor_type="Q4_1")
    model = build(path, "auto")
    cache = tmp_path / "cache"
    kw = {"act_dtype": torch.float32, "budget_s": 0.001, "directory": cache}
    plan = quant_select.select_quantized_kernels(model, **kw)
    assert len(list(cache.glob("*.json"))) == 1
    calls = []
    real_measure = select.measure

    def counting_measure(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real_measure(*args, **kwargs)

    monkeypatch.setattr(select, "measure", counting_measure)
    # NOTE: as loaded as when measured: the cached choice stands (see autotune.cache).
    monkeypatch.setattr(select, "machine_load", lambda: 1000.0)
    assert quant_select.select_quantized_kernels(model, **kw) == plan  # from the cache
    assert calls == []
    quant_select.select_quantized_kernels(model, mode="measure", **kw)
    assert calls == [1]  # "measure" measures again (and refreshes the same file)
    assert len(list(cache.glob("*.json"))) == 1
    monkeypatch.setenv(LAYOUT_ENV, "plain")
    plain_model = build(path, "auto")
    plain_plan = quant_select.select_quantized_kernels(plain_model, **kw)
    assert calls == [1, 1]  # another layout is another cache entry
    assert len(list(cache.glob("*.json"))) == 2
    names = {name for choice in plain_plan.values() for _, name in choice}
    assert not any("x16" in name for name in names)
