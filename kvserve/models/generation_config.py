"""The sampling defaults a model ships, as ``--generation-config`` (vLLM's flag) picks them.

- ``auto`` (the default): an HF folder's ``generation_config.json`` (``temperature``,
  ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``max_new_tokens`` as
  ``max_tokens``: the keys vLLM reads), or a GGUF's ``general.sampling.*`` metadata (the keys
  llama.cpp reads: ``temp``, ``top_p``, ``top_k``, ``min_p``, ``penalty_repeat``);
- ``vllm``: none (the API's and the CLI's own defaults);
- a folder: that folder's ``generation_config.json``.

What it yields is a mapping of ``SamplingParams`` fields to values: the defaults a request
that leaves a field out gets (the server, ``LLM.get_default_sampling_params``, the CLI).

Its ``eos_token_id`` (an id or a list: Gemma's and Llama 3's instruct models end a turn with
a token other than the tokenizer's EOS) is read under every option, ``vllm`` included, as
vLLM's ``update_from_generation_config`` does: the engine stops a request on any of them
(``end_token_ids``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvserve.models.errors import ModelFileNotFoundError, ModelLoadError

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field (vLLM's ``get_diff_sampling_param``).
HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# NOTE: vLLM reads ``GenerationConfig.to_diff_dict()``, which drops a value equal to
# transformers' own default: an explicit "top_k": 50 (transformers' default) is no default
# there, and is none here.
TRANSFORMERS_DEFAULTS: dict[str, float] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "repetition_penalty": 1.0,
}
# GGUF metadata key (llama.cpp's ``general.sampling.*``) -> SamplingParams field.
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
_INT_FIELDS = ("top_k", "max_tokens")


@dataclass(frozen=True)
class GenerationDefaults:
    """The model's sampling defaults (``SamplingParams`` field -> value) and where they came
    from (a file, or None when there are none)."""

    values: Mapping[str, float | int] = field(default_factory=dict)
    source: str | None = None
    eos_token_ids: tuple[int, ...] = ()  # generation_config.json's eos_token_id, as a tuple

    def end_token_ids(self, tokenizer_eos: int | None) -> tuple[int, ...]:
        """The ids besides ``tokenizer_eos`` that end a request as EOS does."""
        return tuple(t for t in self.eos_token_ids if t != tokenizer_eos)

    def describe(self) -> str:
        """One line for the log: the values and their file."""
        items = ", ".join(f"{k} {v:g}" for k, v in self.values.items())
        return f"sampling defaults from {self.source}: {items} (--generation-config vllm: none)"


def load_generation_defaults(option: str, model_path: str) -> GenerationDefaults:
    """The sampling defaults ``--generation-config option`` gives the model at ``model_path``
    (an HF folder or a GGUF file, as ``resolve_model`` returns it). A value no request could
    take (``top_p`` 0, a string) is a ModelLoadError naming the file and the key.

    NOTE: ``EngineConfig`` checks ``option`` (auto, vllm or an existing folder)."""
    if option not in ("auto", "vllm"):
        path = os.path.join(os.path.expanduser(option), GENERATION_CONFIG_FILE)
        if not os.path.isfile(path):
            raise ModelFileNotFoundError(f"--generation-config {option}: no {path}")
        return _hf_defaults(path, sampling=True)
    if not os.path.isdir(model_path):
        return (
            GenerationDefaults()
            if option == "vllm"
            else _checked(_from_gguf(model_path), model_path)
        )
    path = os.path.join(model_path, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return GenerationDefaults()
    return _hf_defaults(path, sampling=option != "vllm")


def _hf_defaults(path: str, *, sampling: bool) -> GenerationDefaults:
    """generation_config.json at ``path``: its end-of-turn ids, and its sampling defaults
    unless ``sampling`` is False (``--generation-config vllm``)."""
    data = _read_hf_file(path)
    defaults = _checked(_from_hf(data), path) if sampling else GenerationDefaults()
    return replace(defaults, eos_token_ids=_eos_ids(data, path))


def _eos_ids(data: Mapping[str, Any], path: str) -> tuple[int, ...]:
    """generation_config.json's ``eos_token_id`` (absent, an id or a list of ids) as a tuple."""
    value = data.get("eos_token_id")
    ids = [value] if isinstance(value, int) else value if isinstance(value, list) else []
    if value is not None and (
        not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        raise ModelLoadError(
            f"{path}: eos_token_id must be a token id or a list of them, got {value!r}"
        )
    return tuple(dict.fromkeys(ids))


def _read_hf_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: must be a JSON object, got {type(data).__name__}")
    return data


def _from_hf(data: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, name in HF_KEYS.items():
        value = data.get(key)
        if value is None or (key in TRANSFORMERS_DEFAULTS and value == TRANSFORMERS_DEFAULTS[key]):
            continue
        out[name] = value
    return out


def _from_gguf(path: str) -> dict[str, Any]:
    from kvserve.models.gguf_reader import read_gguf

    metadata = read_gguf(path).metadata
    return {name: metadata[key] for key, name in GGUF_KEYS.items() if key in metadata}


def _checked(values: dict[str, Any], source: str) -> GenerationDefaults:
    """``values`` as SamplingParams takes them, or ModelLoadError naming ``source``."""
    from kvserve.sampling_params import SamplingParams

    for name, value in values.items():
        if name in _INT_FIELDS and isinstance(value, float) and value.is_integer():
            values[name] = int(value)  # NOTE: a GGUF stores top_k as any number type
        elif name not in _INT_FIELDS and isinstance(value, int) and not isinstance(value, bool):
            values[name] = float(value)
    if not values:
        return GenerationDefaults()
    try:
        SamplingParams(**values)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(
            f"{source}: its sampling defaults {values} are not valid sampling parameters ({e}); "
            "--generation-config vllm ignores them"
        ) from e
    return GenerationDefaults(values, source)
