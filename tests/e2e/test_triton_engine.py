"""The engine with ``attention_backend="triton"`` (kernels under ``TRITON_INTERPRET=1`` on CPU
tensors) generates what ``torch_ref`` generates, through prefix caching, chunked prefill and
a preemption; and the backend's start-up errors name it and why.

A tiny random-weight Llama (2 layers, GQA 2:1): the interpreter runs every kernel program in
Python, so the model and the prompts are kept small.
"""

from __future__ import annotations

import pytest

from kvserve.engine.llm import LLM
from kvserve.runtime.attention import get_attention_backend
from kvserve.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model

# NOTE: TRITON_INTERPRET=1 is set by tests/conftest.py before anything imports triton.
pytest.importorskip("triton")

PREFIX = [300 + 7 * j for j in range(12)]
PROMPTS = [PREFIX + [1000 + 31 * i + 5 * j for j in range(n)] for i, n in enumerate((9, 3, 14))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # NOTE: a wide initializer gives peaked logits, so greedy picks are no near-ties.
    return make_tiny_model(
        tmp_path_factory.mktemp("triton"),
        "llama",
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        initializer_range=0.1,
    )


def _run(model_dir: str, backend: str) -> tuple[list[list[int]], dict]:
    """Two passes (the second hits the prefix cache) in a pool too small for all three."""
    llm = LLM(
        model_dir,
        attention_backend=backend,
        dtype="float32",
        quantization="none",
        kernel_selection="off",
        block_size=4,
        num_kv_blocks=8,
        max_num_batched_tokens=16,
        max_model_len=64,
        enforce_eager=True,
    )
    assert llm.engine.runner.model.attn_backend.name == backend
    tokens = []
    for _ in range(2):
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
    return tokens[0] + tokens[1], llm.stats()


def test_triton_engine_generates_what_torch_ref_generates(model_dir: str) -> None:
    want, ref_stats = _run(model_dir, "torch_ref")
    got, stats = _run(model_dir, "triton")
    assert got == want
    assert all(len(t) == PARAMS.max_tokens for t in got)
    assert stats["preemptions"] > 0 and ref_stats["preemptions"] == stats["preemptions"]
    assert stats["prefix_hit_rate"] > 0
    assert stats["kv_usage"] == 0


def test_triton_without_the_interpreter_on_cpu_is_a_clear_error(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="'triton'.*TRITON_INTERPRET=1"):
        get_attention_backend("triton", "cpu")
    with pytest.raises(ValueError, match="'triton'.*TRITON_INTERPRET=1"):
        LLM(model_dir, attention_backend="triton", kernel_selection="off", num_kv_blocks=8)
    # auto on CPU never picks triton
    assert get_attention_backend("auto", "cpu").name in ("native", "torch_sdpa")


def test_triton_not_installed_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    with pytest.raises(ValueError, match="'triton'.*not installed"):
        get_attention_backend("triton", "cpu")
    # auto on CUDA falls back to torch_sdpa without triton
    assert get_attention_backend("auto", "cuda").name == "torch_sdpa"


def test_enforce_eager_on_cpu_changes_nothing(model_dir: str) -> None:
    """Accepted, and the same tokens with it as without it (CPU captures no graphs)."""
    outs = []
    for eager in (False, True):
        llm = LLM(
            model_dir,
            enforce_eager=eager,
            dtype="float32",
            kernel_selection="off",
            num_kv_blocks=32,
            max_model_len=64,
        )
        outs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)])
    assert outs[0] == outs[1]
