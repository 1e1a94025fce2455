"""Shared fixtures for end-to-end tests on the embedded SmolLM2-135M-Instruct model."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch

from kvserve.models.loader import default_model_path


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def make_llm() -> Iterator[Callable[..., object]]:
    """Factory for LLM instances (each loads the model; a few seconds)."""
    from kvserve.engine.llm import LLM

    torch.set_num_threads(int(os.environ.get("KVSERVE_TEST_THREADS", min(2, os.cpu_count() or 1))))

    def factory(**kwargs: object) -> LLM:
        kwargs.setdefault("max_model_len", 2048)
        # NOTE: the engine's default is dtype="auto" (bf16 on CPUs with native bf16); the
        # e2e checks pin float32 unless a test asks for another dtype.
        kwargs.setdefault("dtype", "float32")
        # NOTE: and the dense path (quantization="none"): the equivalence checks compare
        # token for token, which only a batch-invariant numeric path gives; with the
        # default "auto" a step's row count picks the int8-dot kernel or a dense copy (README,
        # "Quantized weights"). tests/e2e/test_quant_equivalence.py asks for "auto".
        kwargs.setdefault("quantization", "none")
        return LLM(**kwargs)  # type: ignore[arg-type]

    yield factory


@pytest.fixture(scope="session")
def hf_model(model_path: str) -> object:
    """transformers' fp32 model of the embedded GGUF: the reference the e2e checks compare to.

    NOTE: transformers' own load of this GGUF, saved once as safetensors (the same values;
    ``tests.tiny_models.embedded_reference_dir``), so the ~20 s numpy dequantisation runs once.
    """
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import embedded_gguf_path, embedded_reference_dir

    assert os.path.samefile(model_path, embedded_gguf_path())
    model = AutoModelForCausalLM.from_pretrained(embedded_reference_dir(), dtype=torch.float32)
    return model.eval()
