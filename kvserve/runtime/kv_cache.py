"""The pre-allocated tensors of the paged KV cache and its host (CPU) swap tier.

Layout: one tensor of shape ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``
allocated once; ``layer_caches[i]`` is the per-layer view
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = K, 1 = V). The host tier has
the same shape with ``num_host_blocks`` and lives on the CPU (pinned when the device is CUDA).
NOTE: keeping all layers in one tensor makes a block copy or swap one indexed copy for every
layer at once instead of one per layer.

The core owns block ids; this class only moves bytes: ``swap_out`` (device -> host),
``swap_in`` (host -> device) and ``copy_blocks`` (device -> device, copy-on-write).
"""

from __future__ import annotations

import torch


class KVCache:
    """Device block pool + host tier; all copies act on every layer at once."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        num_host_blocks: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        for name, val in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if val < 1:
                raise ValueError(f"{name} must be >= 1, got {val}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        block_shape = (block_size, num_kv_heads, head_dim)
        # NOTE: zero-filled, so padded (masked) reads in attention only ever see finite values.
        self.device_cache = torch.zeros(
            num_layers, 2, num_blocks, *block_shape, dtype=dtype, device=self.device
        )  # [layers, 2, num_blocks, block_size, kvh, d]
        self.host_cache = torch.zeros(
            num_layers,
            2,
            num_host_blocks,
            *block_shape,
            dtype=dtype,
            device="cpu",
            pin_memory=self.device.type == "cuda" and num_host_blocks > 0,
        )  # [layers, 2, num_host_blocks, block_size, kvh, d]
        self.layer_caches: list[torch.Tensor] = list(self.device_cache.unbind(0))

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies across all layers (K and V)."""
        return self.device_cache[:, :, 0].numel() * self.device_cache.element_size()

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: ``pairs`` of (device id, host id)."""
        if not pairs:
            return
        src, dst = self._index(pairs, self.num_blocks, self.num_host_blocks, "swap_out")
        data = self.device_cache.index_select(2, src.to(self.device))
        self.host_cache.index_copy_(2, dst, data.to("cpu"))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks: ``pairs`` of (host id, device id)."""
        if not pairs:
            return
        src, dst = self._index(pairs, self.num_host_blocks, self.num_blocks, "swap_in")
        data = self.host_cache.index_select(2, src)
        self.device_cache.index_copy_(2, dst.to(self.device), data.to(self.device))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks (copy-on-write): ``pairs`` of (src id, dst id).

        All sources are read before any destination is written.
        """
        if not pairs:
            return
        src, dst = self._index(pairs, self.num_blocks, self.num_blocks, "copy_blocks")
        src, dst = src.to(self.device), dst.to(self.device)
        self.device_cache.index_copy_(2, dst, self.device_cache.index_select(2, src))

    @staticmethod
    def _index(
        pairs: list[tuple[int, int]], num_src: int, num_dst: int, what: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        src_ids = [s for s, _ in pairs]
        dst_ids = [d for _, d in pairs]
        if min(src_ids) < 0 or max(src_ids) >= num_src:
            raise ValueError(f"{what}: source block id out of range [0, {num_src}): {src_ids}")
        if min(dst_ids) < 0 or max(dst_ids) >= num_dst:
            raise ValueError(f"{what}: destination block id out of range [0, {num_dst}): {dst_ids}")
        if len(set(dst_ids)) != len(dst_ids):
            raise ValueError(f"{what}: duplicate destination block ids: {dst_ids}")
        return torch.tensor(src_ids, dtype=torch.long), torch.tensor(dst_ids, dtype=torch.long)
