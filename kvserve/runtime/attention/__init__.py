"""Paged attention over the block-structured KV cache: one interface, four backends.

Cache layout (one tensor per layer): ``[2, num_blocks, block_size, num_kv_heads, head_dim]``;
index 0 holds K, index 1 holds V. A token at position ``p`` of a sequence lives in block
``block_ids[p // block_size]`` at offset ``p % block_size``, i.e. at flat slot
``block_ids[p // block_size] * block_size + p % block_size`` of the cache viewed as
``[2, num_blocks * block_size, num_kv_heads, head_dim]``.

Every backend first writes the K/V of ALL new tokens of the step into the cache, and only
then attends. NOTE: the scheduler relies on this order: a block filled by one request in this
step may already be matched from the prefix cache (and read) by another request in the same
step.

The backends share one call, ``forward(q, k, v, kv_cache, meta)`` (``interface.py``):

- ``TorchReferenceBackend`` (``torch_ref.py``): exact and simple; per sequence it computes
  slots from the block table in Python, gathers K/V token by token and runs explicit masked
  softmax attention.
- ``TorchSDPABackend`` (``sdpa.py``): the fast path. The single-token queries (decodes) of the
  step run in a few batches ("decode groups", see ``plan_decode_groups``): per group, whole
  blocks are gathered into ``[B_g, max_len_g, kv_heads, head_dim]`` and one SDPA call attends
  with a length mask (the GQA query heads of one KV head ride in SDPA's query axis).
  Multi-token chunks run one SDPA call each: a chunk starting at position 0 attends its own
  fresh K/V with ``is_causal``; a chunk starting mid-sequence gathers its context from the
  cache and uses an offset causal mask.
- ``TritonBackend`` (``triton/``): Triton kernels, the CUDA path: the K/V write and one
  attention launch per layer for all decodes and chunks of the step, reading K/V in place
  through the block tables (see ``triton/__init__.py``).
- ``NativeCPUBackend`` (``native_cpu.py``): the C++ CPU kernels of ``kvserve.runtime.native``
  (decodes and short chunks straight from the cache blocks), ``TorchSDPABackend``'s path
  where they cannot serve.

All metadata (slot mapping, gather indices, masks) is built once per step and shared by
every layer (``metadata.py``): by ``build_attention_metadata``, except the decodes'
per-backend views (the SDPA decode groups, the native kernel's block tables), which
``AttentionMetadata`` makes on first use.

Windowed attention with sinks (StreamingLLM): with ``sliding_window`` W and
``num_sink_tokens`` S, the query at position p attends to keys k <= p with k < S or
k > p - W. Positions stay absolute: RoPE was applied to each key at write time with its true
position, and queries use their true positions. Blocks that fall out of the window may have
been freed by the core: their block-table entries are ``NULL_BLOCK_ID`` (-1); gathers read
block 0 in their place and the mask hides them.

Quantized caches (``QuantizedLayerCache``, int8 or fp8 with a scale per token per KV head):
new K/V are quantized on write and every read dequantizes to the compute dtype. NOTE: a
chunk that starts at position 0 attends the dequantized values of its own fresh K/V, so both
torch backends see exactly what later steps will read from the cache.
"""

from __future__ import annotations

import torch

from kvserve.runtime import native
from kvserve.runtime.attention.interface import AttentionBackend
from kvserve.runtime.attention.native_cpu import NativeCPUBackend
from kvserve.runtime.attention.sdpa import TorchSDPABackend
from kvserve.runtime.attention.torch_ref import TorchReferenceBackend
from kvserve.runtime.attention.triton import unavailable_reason as triton_unavailable_reason

_BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchReferenceBackend.name: TorchReferenceBackend,
    TorchSDPABackend.name: TorchSDPABackend,
}


ATTENTION_BACKENDS = ("auto", "native", "torch_sdpa", "torch_ref", "triton")


def get_attention_backend(
    name: str = "auto", device: str | torch.device = "cpu"
) -> AttentionBackend:
    """Instantiate an attention backend by name, for a model on ``device``.

    'torch_sdpa', 'torch_ref', 'native' (the C++ CPU kernels, see ``kvserve.runtime.native``;
    ValueError if they cannot be built), 'triton' (the Triton kernels of ``attention/triton``:
    CUDA, or CPU under ``TRITON_INTERPRET=1``; ValueError naming why where they cannot run) or
    'auto': on CUDA 'triton' where it runs, else 'torch_sdpa'; on CPU 'native' where the
    kernels load, else 'torch_sdpa'.
    """
    on_cuda = torch.device(device).type == "cuda"
    if name == "triton" or (name == "auto" and on_cuda):
        reason = triton_unavailable_reason(device)
        if reason is None:
            from kvserve.runtime.attention.triton.backend import TritonBackend

            return TritonBackend()
        if name == "triton":
            raise ValueError(f"attention backend 'triton' cannot run on {str(device)!r}: {reason}")
        return TorchSDPABackend()
    if name in ("native", "auto"):
        if native.available():
            return NativeCPUBackend()
        if name == "native":
            raise ValueError(f"attention backend 'native' is unavailable: {native.reason()}")
        return TorchSDPABackend()
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}"
        ) from None
