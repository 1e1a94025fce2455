"""Torch runtime: paged KV cache tensors, paged attention, input batching, model runner."""

from kvserve.runtime.attention import (
    AttentionBackend,
    AttentionMetadata,
    SeqSpec,
    TorchReferenceBackend,
    TorchSDPABackend,
    build_attention_metadata,
    get_attention_backend,
)
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
