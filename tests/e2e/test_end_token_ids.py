"""A model whose generation_config.json lists several ``eos_token_id`` (Gemma's and Llama 3's
instruct models end a turn with one that is not the tokenizer's EOS) stops on each of them, as
vLLM does, under ``--generation-config auto`` and ``vllm`` alike; ``ignore_eos`` runs on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("eos"), "llama", seed=5, initializer_range=0.2)


def _llm(model: str, **engine: object) -> LLM:
    return LLM(
        model,
        dtype="float32",
        quantization="none",
        kernel_selection="off",
        num_kv_blocks=16,
        max_model_len=64,
        **engine,
    )


def _tokens(llm: LLM, params: SamplingParams):  # type: ignore[no-untyped-def]
    return llm.generate([[11, 12, 13, 14, 15]], params, use_tqdm=False)[0].outputs[0]


def test_every_eos_token_id_of_the_generation_config_ends_the_request(model_dir: str) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    stop = SamplingParams(temperature=0.0, max_tokens=12)
    free = _tokens(_llm(model_dir), greedy)
    assert len(free.token_ids) == 12
    end = free.token_ids[3]
    first = free.token_ids.index(end)  # the first time it comes
    config = Path(model_dir) / "generation_config.json"
    saved = config.read_text()
    config.write_text(json.dumps({**json.loads(saved), "eos_token_id": [0, end]}))
    try:
        for option in ("auto", "vllm"):
            llm = _llm(model_dir, generation_config=option)
            out = _tokens(llm, stop)
            assert list(out.token_ids) == list(free.token_ids[: first + 1]), option
            assert out.finish_reason == "stop"
            assert list(_tokens(llm, greedy).token_ids) == list(free.token_ids)
    finally:
        config.write_text(saved)
