"""Start-up memory budget: the KV pool gets what the budget leaves, the process stays within
it (peak RSS measured in a fresh subprocess), and a budget that is too small fails at
start-up saying how many bytes are missing."""

from __future__ import annotations

import json
import mmap
import os
import re
import subprocess
import sys
import textwrap

import pytest

from kvserve.config import ModelArchConfig
from kvserve.engine.config import EngineConfig, GiB
from kvserve.engine.memory_budget import (
    HEADROOM_BYTES,
    MemoryBudgetError,
    load_peak_bytes,
    measure_growth,
    plan_kv_blocks,
)

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARCH = ModelArchConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
KV_PER_TOKEN = ARCH.kv_bytes_per_token(4)  # 46080 bytes: fp32 SmolLM2-135M
WEIGHTS = 538_060_032  # fp32 SmolLM2-135M parameters


def _plan(  # type: ignore[no-untyped-def]
    budget: int,
    *,
    activation_bytes: int = 50 * MiB,
    max_model_len: int = 2048,
    tracing_bytes: int = 0,
    **kw,
):
    return plan_kv_blocks(
        EngineConfig(memory_budget=budget, **kw),
        ARCH,
        weights_bytes=WEIGHTS,
        kv_bytes_per_token=KV_PER_TOKEN,
        max_model_len=max_model_len,
        activation_bytes=activation_bytes,
        tracing_bytes=tracing_bytes,
    )


# --------------------------------------------------------------------- the arithmetic


def test_kv_pool_gets_every_remaining_byte() -> None:
    budget = 2 * GiB
    rep = _plan(budget)
    block_bytes = 16 * KV_PER_TOKEN
    left = budget - WEIGHTS - 50 * MiB - HEADROOM_BYTES
    assert rep.num_kv_blocks == left // block_bytes
    assert 0 <= left - rep.kv_cache_bytes < block_bytes
    assert rep.headroom_bytes == HEADROOM_BYTES


def test_missing_bytes_are_exact() -> None:
    # The smallest budget that fits is the failing budget plus the reported shortfall.
    for max_model_len in (256, 4096, 8192):
        budget = 1 * GiB + 200 * MiB
        with pytest.raises(MemoryBudgetError, match="are missing") as info:
            _plan(budget, max_model_len=max_model_len, activation_bytes=600 * MiB)
        missing = int(re.search(r"; (\d+) bytes \([\d.]+ MiB\) are missing", str(info.value))[1])
        assert missing > 0
        rep = _plan(budget + missing, max_model_len=max_model_len, activation_bytes=600 * MiB)
        assert rep.max_tokens_in_cache >= max_model_len
        with pytest.raises(MemoryBudgetError):
            _plan(budget + missing - 1, max_model_len=max_model_len, activation_bytes=600 * MiB)


def test_loading_must_fit_too() -> None:
    # Weights are briefly held twice while loading: a budget below that fails even when the
    # steady state (weights once + a tiny KV pool) would fit.
    budget = load_peak_bytes(WEIGHTS) - 1
    assert budget > WEIGHTS + HEADROOM_BYTES + 16 * KV_PER_TOKEN
    with pytest.raises(MemoryBudgetError, match=r"loading needs \d+ .* 1 bytes \("):
        _plan(budget, max_model_len=16, activation_bytes=0)


def test_explicit_kv_size_must_fit_the_budget() -> None:
    with pytest.raises(MemoryBudgetError, match="too small for the requested KV cache"):
        _plan(2 * GiB, num_kv_blocks=100_000)
    assert _plan(2 * GiB, num_kv_blocks=10).num_kv_blocks == 10


def test_cpu_swap_tier_is_carved_from_the_budget() -> None:
    plain = _plan(3 * GiB)
    swap = _plan(3 * GiB, preemption_mode="swap")
    assert swap.num_host_blocks == swap.num_kv_blocks
    assert abs(2 * swap.num_kv_blocks - plain.num_kv_blocks) <= 1
    sized = _plan(3 * GiB, swap_space=256 * MiB)
    assert sized.kv_cache_bytes + sized.host_cache_bytes <= plain.kv_cache_bytes


def test_kernel_scratch_is_its_own_term_carved_from_the_pool() -> None:
    def plan(scratch):  # type: ignore[no-untyped-def]
        return plan_kv_blocks(
            EngineConfig(memory_budget=2 * GiB),
            ARCH,
            weights_bytes=WEIGHTS,
            kv_bytes_per_token=KV_PER_TOKEN,
            max_model_len=2048,
            activation_bytes=50 * MiB,
            kernel_scratch_bytes=scratch,
        )

    unmeasured, measured = plan(None), plan(10 * MiB)
    block_bytes = 16 * KV_PER_TOKEN
    assert abs(unmeasured.kv_cache_bytes - measured.kv_cache_bytes - 10 * MiB) < block_bytes
    assert measured.activation_bytes == unmeasured.activation_bytes == 50 * MiB
    assert "kernel scratch (GEMM library buffers, measured at start-up): 10.0 MiB" in "\n".join(
        measured.lines()
    )
    assert "not measured" in "\n".join(unmeasured.lines())
    with pytest.raises(ValueError, match="kernel_scratch_bytes=-1"):
        plan(-1)


def test_the_traces_imports_are_added_to_the_headroom() -> None:
    # Tracing the plan imports torch._dynamo (and triton, where installed): what it left
    # resident is measured at start-up and comes out of the pool, not out of the budget.
    plain, traced = _plan(2 * GiB), _plan(2 * GiB, tracing_bytes=100 * MiB)
    assert traced.headroom_bytes == plain.headroom_bytes + 100 * MiB
    assert abs(plain.kv_cache_bytes - traced.kv_cache_bytes - 100 * MiB) < 16 * KV_PER_TOKEN
    assert "of which the plan's trace (its imports, measured): 100.0 MiB" in "\n".join(
        traced.lines()
    )

    # NOTE: fresh anonymous pages, written: a heap allocation may reuse pages an earlier test
    # freed (resident already), which is the point of measuring, but not testable.
    def touch() -> mmap.mmap:
        pages = mmap.mmap(-1, 64 * MiB)
        pages.write(b"\1" * (64 * MiB))
        return pages

    grown, added = measure_growth("cpu", touch)
    assert len(grown) == 64 * MiB and added >= 48 * MiB
    assert measure_growth("meta", lambda: 7) == (7, 0)  # an accelerator's budget is its own


def test_report_lines_show_the_breakdown() -> None:
    text = "\n".join(_plan(2 * GiB).lines())
    for key in ("memory budget", "weights", "activations", "headroom", "KV cache", "max tokens"):
        assert key in text


# ------------------------------------------------------------------- the real process

_RUN = textwrap.dedent(
    """
    import json, sys
    from kvserve import LLM, SamplingParams
    budget = int(sys.argv[1])
    llm = LLM(memory_budget=budget, max_model_len=1024, max_num_seqs=8,
              max_num_batched_tokens=128, num_threads=2, dtype="float32",
              kernel_selection="off", quantization="none")
    rep = llm.engine.memory_report
    prompts = [[100 + 7 * i + j for j in range(60 + 30 * i)] for i in range(8)]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    print(json.dumps({
        "vm_hwm": int(status["VmHWM"].split()[0]) * 1024,
        "weights": rep.weights_bytes, "kv": rep.kv_cache_bytes,
        "activations": rep.activation_bytes, "headroom": rep.headroom_bytes,
        "kernel_scratch": rep.kernel_scratch_bytes,
        "num_outputs": sum(len(o.outputs[0].token_ids) for o in outs),
    }))
    """
)


def _run_budgeted(budget: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "-c", _RUN, str(budget)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )


# NOTE: dense float32 (`quantization="none"`) with torch.mm everywhere: the figures above
# (WEIGHTS) are that model's. A prepacked kernel copy adds its bytes to the weights
# (MemoryReport.packed_weights_bytes).
def test_peak_rss_stays_within_the_budget() -> None:
    budget = 3 * GiB // 2
    proc = _run_budgeted(budget)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["num_outputs"] == 8 * 24
    # The pool took what the budget left (less than one block of 16 tokens is unused) ...
    assert got["kernel_scratch"] is not None  # measured: the engine has a budget
    fixed = got["weights"] + got["activations"] + got["kernel_scratch"] + got["headroom"]
    assert 0 <= budget - fixed - got["kv"] < 16 * KV_PER_TOKEN
    # ... it is really resident (zero-filled), and the whole process stayed in the budget.
    assert got["vm_hwm"] >= got["weights"] + got["kv"]
    assert got["vm_hwm"] <= budget, (
        f"peak RSS {got['vm_hwm']} exceeds the budget {budget} by "
        f"{(got['vm_hwm'] - budget) / MiB:.1f} MiB"
    )


def test_too_small_budget_fails_at_startup_with_the_shortfall() -> None:
    proc = _run_budgeted(GiB)
    assert proc.returncode != 0
    assert "MemoryBudgetError" in proc.stderr
    match = re.search(r"(\d+) bytes \(([\d.]+) MiB\) are missing", proc.stderr)
    assert match, proc.stderr[-2000:]
    assert int(match[1]) >= load_peak_bytes(WEIGHTS) - GiB


def _plan_packed(budget: int, packed: int, activation_bytes: int = 50 * MiB):  # type: ignore[no-untyped-def]
    return plan_kv_blocks(
        EngineConfig(memory_budget=budget),
        ARCH,
        weights_bytes=WEIGHTS,
        kv_bytes_per_token=KV_PER_TOKEN,
        max_model_len=2048,
        activation_bytes=activation_bytes,
        packed_weights_bytes=packed,
    )


def test_prepacked_copies_count_as_weights_but_not_twice_at_load() -> None:
    packed = 200 * MiB
    rep = _plan_packed(3 * GiB, packed)
    assert rep.packed_weights_bytes == packed
    assert any("prepacked kernel copies" in line for line in rep.lines())
    assert rep.num_kv_blocks == _plan(3 * GiB).num_kv_blocks  # in weights_bytes already
    # The copies are made after the loader's state dict is freed: the load check sees the
    # unpacked weights twice.
    with pytest.raises(MemoryBudgetError) as info:
        _plan_packed(GiB, packed, activation_bytes=0)
    assert f"loading needs {load_peak_bytes(WEIGHTS - packed)} " in str(info.value)
