"""Speculative decoding with a draft model (issue 52): outputs are plain decoding's.

Tiny random-weight models sharing the embedded tokenizer (``tests/tiny_models.py``), dense
float32: a 2-layer target, and as drafts the target itself (every draft right on greedy),
the target with noise on its weights (about half right) or another random 1-layer model
(all wrong). Greedy output equals plain decoding with
prefix caching, with a pool small enough to preempt (recompute and swap) in the middle of
speculation, and with ``check_integrity`` after every step; seeded sampling equals plain
seeded sampling; the draft's KV is counted in every block; bad drafts are refused at
start-up naming the field.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from kvserve.sampling_params import SamplingParams

KW = dict(
    dtype="float32",
    quantization="none",
    max_model_len=256,
    block_size=16,
    max_num_seqs=8,
    num_kv_blocks=64,
)
SHARED = list(range(5, 25))  # 20 tokens: a full block of 16 to share
PROMPTS = [
    SHARED,
    [300 + i for i in range(18)],
    [1000 + i for i in range(37)],
    SHARED[:16] + [40, 41, 42],  # admitted after another finished: a prefix hit
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from tests.tiny_models import make_tiny_model

    tmp = tmp_path_factory.mktemp("draft")
    target = make_tiny_model(tmp, name="target", num_hidden_layers=2)
    return {
        "target": target,
        "noisy": _noisy_copy(target, tmp / "noisy", 0.12),
        "draft": make_tiny_model(tmp, name="draft", seed=1, num_hidden_layers=1),
        "vocab": make_tiny_model(tmp, name="vocab", vocab_size=32000, num_hidden_layers=1),
    }


def _noisy_copy(src: str, dst: Path, scale: float) -> str:
    """``src`` with Gaussian noise (``scale`` x each matrix's std) on its layer matrices:
    a draft that agrees with the target some of the time (at 0.12: ~45% of the drafts
    accepted, some at every position)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(f"{src}/model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if w.dim() == 2 and "embed" not in name:
            weights[name] = w + scale * w.std() * torch.randn(w.shape, generator=gen)
    save_file(weights, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def plain(models: dict[str, str], make_llm: Callable[..., object]) -> object:
    return make_llm(model=models["target"], **KW)


def _draft(path: str, **extra: object) -> dict[str, object]:
    return {"model": path, "num_speculative_tokens": 3, "adaptive": False, **extra}


def _run(llm: object, params: list[SamplingParams]) -> list[list[int]]:
    """Every prompt through ``llm``'s engine step by step, ``check_integrity`` after each."""
    engine = llm.engine  # type: ignore[attr-defined]
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(prompt, p, request_id=f"r{i}")
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [t for o in out.outputs for t in o.token_ids]
        engine.kv_cache_manager.check_integrity()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    return [done[f"r{i}"] for i in range(len(PROMPTS))]


GREEDY = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(PROMPTS)
GREEDY[1] = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, n=2)  # a fork


SMALL = {**KW, "num_kv_blocks": 10, "max_num_seqs": 3}  # preempts; a later prefix hit


def _check_preempted(stats: dict[str, float], mode: str) -> None:
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    if mode == "swap":
        assert stats["preemptions_swap"] > 0 and stats["swap_in_blocks"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_target_as_its_own_draft_accepts_every_draft(
    mode: str, models: dict[str, str], plain: object, make_llm: Callable[..., object]
) -> None:
    # NOTE: the draft proposes the target's own greedy tokens only while its KV is right:
    # after swaps, recomputes and prefix hits too (a draft KV lost or stale would reject).
    spec = make_llm(
        model=models["target"],
        speculative_config=_draft(models["target"]),
        **{**SMALL, "preemption_mode": mode},
    )
    assert _run(spec, GREEDY) == _run(plain, GREEDY)
    stats = spec.engine.stats()  # type: ignore[attr-defined]
    _check_preempted(stats, mode)
    assert stats["spec_decode_num_draft_tokens"] > 50
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]


def test_noisy_draft_with_preemption_is_plain_decoding(
    models: dict[str, str], plain: object, make_llm: Callable[..., object]
) -> None:
    spec = make_llm(model=models["target"], speculative_config=_draft(models["noisy"]), **SMALL)
    assert _run(spec, GREEDY) == _run(plain, GREEDY)
    stats = spec.engine.stats()  # type: ignore[attr-defined]
    _check_preempted(stats, "recompute")
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_num_accepted_tokens_per_pos_2"] > 0  # all 3 accepted: catch-up
    # Seeded sampling draws the same number per output position as plain decoding.
    seeded = [SamplingParams(temperature=0.9, seed=s, max_tokens=24) for s in range(len(PROMPTS))]
    assert _run(spec, seeded) == _run(plain, seeded)


def test_capacity_counts_the_drafts_kv(
    models: dict[str, str], plain: object, make_llm: Callable[..., object]
) -> None:
    memory = 1 << 20
    kw = {**KW, "num_kv_blocks": None, "kv_cache_memory": memory}
    base = make_llm(model=models["target"], **kw).engine.memory_report  # type: ignore[attr-defined]
    spec = make_llm(model=models["target"], speculative_config=_draft(models["draft"]), **kw)
    report = spec.engine.memory_report  # type: ignore[attr-defined]
    assert _run(spec, GREEDY) == _run(plain, GREEDY)  # an unrelated draft: all rejected
    assert spec.engine.stats()["spec_decode_num_draft_tokens"] > 50  # type: ignore[attr-defined]
    # 2 target layers + 1 draft layer, 2 KV heads x 16 dims, K and V, float32.
    assert base.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert report.kv_bytes_per_token == base.kv_bytes_per_token * 3 // 2
    assert report.num_kv_blocks == memory // (16 * report.kv_bytes_per_token)
    assert report.num_kv_blocks < base.num_kv_blocks
    stats = spec.engine.stats()  # type: ignore[attr-defined]
    assert stats["num_kv_blocks"] == report.num_kv_blocks
    assert stats["kv_bytes_per_token"] == report.kv_bytes_per_token
    assert report.weights_bytes > base.weights_bytes


def test_bad_drafts_are_refused_naming_the_field(
    models: dict[str, str], tmp_path: Path, make_llm: Callable[..., object]
) -> None:
    with pytest.raises(ValueError, match=r"speculative_config\.model.*no such model"):
        make_llm(model=models["target"], speculative_config=_draft(str(tmp_path / "nope")), **KW)
    with pytest.raises(ValueError, match=r"speculative_config\.model.*vocab_size 32000"):
        make_llm(model=models["target"], speculative_config=_draft(models["vocab"]), **KW)
    other = tmp_path / "other-tokenizer"
    shutil.copytree(models["draft"], other)
    config = other / "tokenizer_config.json"
    config.write_text(
        config.read_text().replace('"eos_token": "<|im_end|>"', '"eos_token": "<|im_start|>"')
    )
    with pytest.raises(ValueError, match=r"speculative_config\.model.*tokenizer eos_token_id"):
        make_llm(model=models["target"], speculative_config=_draft(str(other)), **KW)
    from tests.tiny_models import make_tiny_model

    gemma = make_tiny_model(tmp_path, "gemma2", num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"speculative_config\.model.*mix full and sliding"):
        make_llm(model=models["target"], speculative_config=_draft(gemma), **KW)


def test_a_step_run_in_halves_keeps_the_verification(
    models: dict[str, str], plain: object, make_llm: Callable[..., object]
) -> None:
    """A step whose whole batch raises once is run again in halves (``step_guard``): each
    half's accepted drafts must come back with its sampled tokens."""
    spec = make_llm(model=models["target"], speculative_config=_draft(models["target"]), **KW)
    engine = spec.engine  # type: ignore[attr-defined]
    execute, raised = engine.runner.execute, []

    def flaky(sched: object) -> object:
        step = engine.num_steps
        if step in (4, 7) and step not in raised and len(sched.scheduled) > 1:  # type: ignore[attr-defined]
            raised.append(step)
            raise RuntimeError("injected: the whole batch")
        return execute(sched)

    engine.runner.execute = flaky
    assert _run(spec, GREEDY) == _run(plain, GREEDY)
    assert raised == [4, 7]
    stats = engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 50
