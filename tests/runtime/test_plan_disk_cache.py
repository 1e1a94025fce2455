"""The activation plan on disk: a second start-up with the same arguments reads the plan back
without tracing; other arguments plan anew; an unreadable file costs a re-plan, not a start."""

from __future__ import annotations

import pytest

from kvserve.config import ModelArchConfig
from kvserve.models.llama import LlamaForCausalLM
from kvserve.runtime.memory_plan import disk_cache, planner
from kvserve.runtime.memory_plan.planner import plan_activations

ARCH = ModelArchConfig(
    architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    max_position_embeddings=64,
)  # fmt: skip


def _plan(num_threads: int = 1) -> planner.ActivationPlan:
    return plan_activations(
        ARCH, max_num_batched_tokens=8, max_num_seqs=2, max_model_len=32, block_size=4,
        num_threads=num_threads, attn_backend="torch_ref", model_factory=LlamaForCausalLM,
    )  # fmt: skip


@pytest.fixture
def on_disk(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.delenv(disk_cache.DISABLE_ENV, raising=False)
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    planner._plan_cached.cache_clear()  # NOTE: a fresh process, as a second start-up is
    yield disk_cache.plan_cache_dir()
    planner._plan_cached.cache_clear()


def _no_tracing(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def boom(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("traced a step the disk cache holds")

    monkeypatch.setattr(planner, "trace_step", boom)


def test_a_second_start_reads_the_plan_back(on_disk, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    first = _plan()
    assert len(list(on_disk.glob("*.pkl"))) == 1
    planner._plan_cached.cache_clear()
    _no_tracing(monkeypatch)
    assert _plan() == first
    with pytest.raises(AssertionError, match="traced a step"):
        _plan(num_threads=2)  # another argument: another key, traced anew


def test_an_unreadable_plan_is_planned_again(on_disk) -> None:  # type: ignore[no-untyped-def]
    first = _plan()
    (path,) = on_disk.glob("*.pkl")
    path.write_bytes(b"not a pickle")
    planner._plan_cached.cache_clear()
    assert _plan() == first
    assert path.read_bytes() != b"not a pickle"  # rewritten


def test_the_switch_turns_the_disk_cache_off(on_disk, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(disk_cache.DISABLE_ENV, "0")
    _plan()
    assert not on_disk.exists() or not list(on_disk.glob("*.pkl"))


def test_the_key_covers_the_code_and_the_machine(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    args = (ARCH, 8, LlamaForCausalLM)
    key = disk_cache.plan_key(args)
    assert key == disk_cache.plan_key(args)
    monkeypatch.setattr(disk_cache, "source_digest", lambda: "edited")
    assert disk_cache.plan_key(args) != key
    monkeypatch.undo()
    monkeypatch.setattr(disk_cache, "cpu_flags", lambda: "avx2 fma")
    assert disk_cache.plan_key(args) != key
