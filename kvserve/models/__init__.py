"""Model weights: GGUF / HF loading (loader.py) and the Llama-family model (llama.py)."""

from kvserve.models.errors import ModelFileNotFoundError, ModelLoadError
from kvserve.models.export import export_hf_dir
from kvserve.models.loader import LoadedModel, default_model_path, load_model, resolve_model

__all__ = [
    "LoadedModel",
    "ModelFileNotFoundError",
    "ModelLoadError",
    "default_model_path",
    "export_hf_dir",
    "load_model",
    "resolve_model",
]
