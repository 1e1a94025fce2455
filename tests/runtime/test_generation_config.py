"""``--generation-config``: which sampling defaults a model ships (an HF folder's
generation_config.json, a GGUF's ``general.sampling.*`` keys), what vLLM's reading drops, and
the errors of a bad file or option. The embedded GGUF has none (llama.cpp's CLI defaults
then apply to ``kvserve generate``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.engine.config import EngineConfig
from kvserve.models.errors import ModelFileNotFoundError, ModelLoadError
from kvserve.models.generation_config import GGUF_KEYS, load_generation_defaults
from kvserve.models.gguf_reader import read_gguf
from kvserve.models.loader import default_model_path
from tests.tiny_gguf import make_tiny_gguf


def _folder(tmp_path: Path, config: dict) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_the_embedded_gguf_has_no_sampling_defaults() -> None:
    path = default_model_path()
    assert not [k for k in read_gguf(path).metadata if k.startswith("general.sampling.")]
    assert load_generation_defaults("auto", path).values == {}


def test_hf_generation_config_keys_and_what_vllm_drops(tmp_path: Path) -> None:
    folder = _folder(
        tmp_path,
        {
            "do_sample": True,  # ignored, as vLLM ignores it
            "temperature": 0.6,
            "top_p": 0.9,
            "top_k": 50,  # transformers' own default: dropped (vLLM's to_diff_dict)
            "min_p": None,
            "repetition_penalty": 1.0,  # transformers' default: dropped
            "max_new_tokens": 256,
            "max_length": 20,  # not read (vLLM reads max_new_tokens only)
            "eos_token_id": [2, 7],
        },
    )
    defaults = load_generation_defaults("auto", folder)
    assert dict(defaults.values) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 256}
    assert defaults.source == str(tmp_path / "generation_config.json")
    assert "temperature 0.6" in defaults.describe()
    assert load_generation_defaults("vllm", folder).values == {}
    # The end-of-turn ids are read under every option (vLLM's update_from_generation_config).
    assert defaults.eos_token_ids == (2, 7)
    assert load_generation_defaults("vllm", folder).eos_token_ids == (2, 7)
    assert defaults.end_token_ids(2) == (7,)


@pytest.mark.parametrize("value", [[], "2", [1, "x"], [-1], True])
def test_a_bad_eos_token_id_names_the_file(tmp_path: Path, value: object) -> None:
    with pytest.raises(ModelLoadError, match="generation_config.json: eos_token_id"):
        load_generation_defaults("auto", _folder(tmp_path, {"eos_token_id": value}))


def test_a_folder_without_generation_config_has_no_defaults(tmp_path: Path) -> None:
    assert load_generation_defaults("auto", str(tmp_path)).values == {}
    with pytest.raises(ModelFileNotFoundError, match="generation_config.json"):
        load_generation_defaults(str(tmp_path), str(tmp_path))


def test_gguf_sampling_keys_are_read(tmp_path: Path) -> None:
    assert set(GGUF_KEYS) == {
        "general.sampling.temp",
        "general.sampling.top_p",
        "general.sampling.top_k",
        "general.sampling.min_p",
        "general.sampling.penalty_repeat",
    }
    meta = {"general.sampling.temp": 0.6, "general.sampling.top_k": 20}
    path = make_tiny_gguf(tmp_path, "llama", tensor_type="F32", metadata=meta)
    values = load_generation_defaults("auto", path).values
    assert values == {"temperature": pytest.approx(0.6), "top_k": 20}
    assert isinstance(values["top_k"], int)


@pytest.mark.parametrize(
    "config, field",
    [({"top_p": 0.0}, "top_p"), ({"temperature": "hot"}, "temperature"), ({"top_k": -5}, "top_k")],
)
def test_a_bad_value_names_the_file(tmp_path: Path, config: dict, field: str) -> None:
    folder = _folder(tmp_path, config)
    with pytest.raises(ModelLoadError, match=rf"generation_config\.json.*{field}"):
        load_generation_defaults("auto", folder)


def test_not_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{temperature")
    with pytest.raises(ModelLoadError, match="generation_config.json: not readable JSON"):
        load_generation_defaults("auto", str(tmp_path))


def test_engine_config_takes_auto_vllm_or_a_folder(tmp_path: Path) -> None:
    assert EngineConfig(generation_config="vllm").generation_config == "vllm"
    assert EngineConfig(generation_config=str(tmp_path)).generation_config == str(tmp_path)
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a folder"):
        EngineConfig(generation_config="hf")
