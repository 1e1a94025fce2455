"""The model id (``/v1/models``, responses' ``model``, the start-up line) names the weights as
run: a GGUF's format tag stays while its tensors run as stored and goes when they are
dequantized at load (``--quantization none`` served "SmolLM2-135M-Instruct.Q4_1")."""

from __future__ import annotations

import pytest

from kvserve.models.quant_model import model_id
from kvserve.server.context import default_model_name

GGUF = "/m/SmolLM2-135M-Instruct.Q4_1.gguf"


def _summary(mode: str, *formats: str) -> dict:
    return {"mode": mode, "weight_bytes_by_format": {"dense": 10, **dict.fromkeys(formats, 5)}}


@pytest.mark.parametrize(
    "path, summary, expected",
    [
        (GGUF, _summary("auto", "q4_1", "q8_0"), "SmolLM2-135M-Instruct.Q4_1"),
        (GGUF, _summary("none"), "SmolLM2-135M-Instruct"),
        (GGUF, _summary("auto"), "SmolLM2-135M-Instruct"),  # auto, dense (off the CPU)
        (GGUF, _summary("q8_0", "q8_0"), "SmolLM2-135M-Instruct.Q8_0"),
        ("/m/Llama-3-8B-Q4_K_M.gguf", _summary("none"), "Llama-3-8B"),
        ("/m/model-f16.gguf", _summary("q4_0", "q4_0"), "model.Q4_0"),
        ("/m/tiny-llama/", _summary("none"), "tiny-llama"),
        ("/m/tiny-llama", _summary("q8_0", "q8_0"), "tiny-llama.Q8_0"),
        ("/m/Qwen2-0.5B", _summary("none"), "Qwen2-0.5B"),  # not a format tag
        (GGUF, None, "SmolLM2-135M-Instruct.Q4_1"),
        (None, None, "kvserve-model"),
    ],
)
def test_model_id_names_the_weights_as_run(path, summary, expected) -> None:
    assert model_id(path, summary) == expected
    assert default_model_name(path, summary) == expected


def test_served_id_under_quantization_none_has_no_q4_1(make_llm) -> None:
    """The embedded Q4_1 GGUF dequantized at load: its id carries no Q4_1."""
    llm = make_llm(quantization="none", num_kv_blocks=16, max_model_len=64)
    engine = llm.engine
    assert default_model_name(engine.model_path, engine.quantization) == "SmolLM2-135M-Instruct"
