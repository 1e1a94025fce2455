"""The attention backend interface: ``AttentionBackend.forward(q, k, v, kv_cache, meta)``.

Every backend writes the K/V of all new tokens of the step into the layer's cache before it
attends (the order the scheduler relies on; see the package docstring), and reads the
context through the step's ``AttentionMetadata``.
"""

from __future__ import annotations

import abc

import torch

from kvserve.runtime.attention.metadata import AttentionMetadata
from kvserve.runtime.kv_cache import QuantizedLayerCache

LayerCache = torch.Tensor | QuantizedLayerCache


class AttentionBackend(abc.ABC):
    """Paged attention: write new K/V into the cache, then attend through block tables.

    Invariants every backend keeps:
    - the K/V of all ``meta.num_tokens`` new tokens are written to their slots before any
      query of the step reads the cache;
    - query ``i`` of a sequence (position ``start_pos + i``) attends exactly to positions
      ``<= start_pos + i`` of its own sequence (and within ``sliding_window`` if set);
    - the result equals ``TorchReferenceBackend`` up to float summation order.
    """

    name: str = "abstract"

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: LayerCache,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,  # [T, num_heads, head_dim] scratch, q's dtype
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k/v into ``kv_cache`` and return attention output for ``q``.

        ``out``: a buffer the backend may write the result into (and return) instead of
        allocating one; the caller reads only the returned tensor.
        """
