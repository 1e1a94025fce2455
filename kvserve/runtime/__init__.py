"""Torch runtime: paged KV cache tensors, paged attention, input batching, model runner."""

from kvserve.runtime.attention import get_attention_backend
from kvserve.runtime.attention.interface import AttentionBackend
from kvserve.runtime.attention.metadata import AttentionMetadata, SeqSpec, build_attention_metadata
from kvserve.runtime.attention.sdpa import TorchSDPABackend
from kvserve.runtime.attention.torch_ref import TorchReferenceBackend
from kvserve.runtime.input_batch import InputBatch, build_input_batch
from kvserve.runtime.kv_cache import KVCache

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "InputBatch",
    "KVCache",
    "SeqSpec",
    "TorchReferenceBackend",
    "TorchSDPABackend",
    "build_attention_metadata",
    "build_input_batch",
    "get_attention_backend",
]
