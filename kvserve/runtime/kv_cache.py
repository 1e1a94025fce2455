"""The pre-allocated tensors of the paged KV cache and its host (CPU) swap tier.

Layout: one tensor of shape ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``
allocated once; ``layer_caches[i]`` is the per-layer view
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = K, 1 = V). The host tier has
the same shape with ``num_host_blocks`` and lives on the CPU (pinned when the device is CUDA).
NOTE: keeping all layers in one tensor makes a block copy or swap one indexed copy for every
layer at once instead of one per layer.

Quantized caches (``kv_cache_dtype`` "int8" or "fp8"): the elements are stored in one byte
each (int8, or float8_e4m3fn kept as raw uint8 bytes so that index copies work on every
device) and a float32 scale per token per KV head is stored beside them, in a tensor of shape
``[num_layers, 2, num_blocks, block_size, num_kv_heads]``. ``layer_caches[i]`` is then a
``QuantizedLayerCache`` (data view + scales view); the attention backends quantize on write
and dequantize on read. Swaps and copies move the scales with the blocks.

The core owns block ids; this class only moves bytes: ``swap_out`` (device -> host),
``swap_in`` (host -> device) and ``copy_blocks`` (device -> device, copy-on-write).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.runtime.huge_pages import zeros_huge

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
SCALE_DTYPE = torch.float32
# NOTE: floor for scales so an all-zero token head quantizes to 0 without a 0/0.
_MIN_SCALE = 1e-12


@dataclass(slots=True)
class QuantizedLayerCache:
    """One layer of a quantized cache: 1-byte elements plus a scale per token per KV head."""

    data: torch.Tensor  # [2, num_blocks, block_size, kvh, d] int8 or uint8 (fp8 bytes)
    scales: torch.Tensor  # [2, num_blocks, block_size, kvh] float32
    kind: str  # "int8" or "fp8"

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device


def _storage_dtype(kind: str) -> torch.dtype:
    return torch.int8 if kind == "int8" else torch.uint8


def check_kv_cache_dtype(kind: str, device: str | torch.device = "cpu") -> None:
    """Raise ValueError if ``kind`` is unknown or (fp8) unsupported by torch on ``device``."""
    if kind not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kind!r}")
    if kind != "fp8":
        return
    if not hasattr(torch, "float8_e4m3fn"):
        raise ValueError("kv_cache_dtype='fp8' needs torch.float8_e4m3fn (torch >= 2.1)")
    try:
        probe = torch.ones(2, device=device).to(torch.float8_e4m3fn).view(torch.uint8)
        probe.view(torch.float8_e4m3fn).to(torch.float32)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"kv_cache_dtype='fp8' is not supported on device {device!r}: {e}") from e


def quantize_kv(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize K or V per token per head: ``x`` [..., head_dim] -> (bytes, scales [...]).

    int8: symmetric, ``scale = amax / 127``, ``q = round(x / scale)``, so the error of every
    element is at most ``scale / 2``. fp8: ``scale = amax / 448`` and ``x / scale`` is cast
    to float8_e4m3fn (3 mantissa bits: relative error <= 2**-4 in the normal range); the
    bytes are returned as uint8.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1)  # [...]
    if kind == "int8":
        scale = (amax / INT8_MAX).clamp_min_(_MIN_SCALE)
        q = (xf / scale.unsqueeze(-1)).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return q, scale
    if kind == "fp8":
        scale = (amax / FP8_E4M3_MAX).clamp_min_(_MIN_SCALE)
        q = (xf / scale.unsqueeze(-1)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        return q.to(torch.float8_e4m3fn).view(torch.uint8), scale
    raise ValueError(f"quantize_kv: unknown kind {kind!r} (int8 or fp8)")


def dequantize_kv(
    q: torch.Tensor, scale: torch.Tensor, kind: str, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`quantize_kv`: (bytes [..., d], scales [...]) -> values [..., d]."""
    if kind == "fp8":
        q = q.view(torch.float8_e4m3fn)
    return (q.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


def kv_bytes_per_token(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    kv_cache_dtype: str,
    dtype: torch.dtype,
) -> int:
    """Exact cache bytes one token occupies across all layers, K and V, scales included."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
    scale_bytes = torch.empty(0, dtype=SCALE_DTYPE).element_size()
    return 2 * num_layers * num_kv_heads * (head_dim + scale_bytes)


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
        kv_cache_dtype: str = "auto",
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
        check_kv_cache_dtype(kv_cache_dtype, self.device)
        self.dtype = dtype  # the compute dtype attention reads back
        self.kv_cache_dtype = kv_cache_dtype
        self.quantized = kv_cache_dtype != "auto"
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        store = _storage_dtype(kv_cache_dtype) if self.quantized else dtype
        pin = self.device.type == "cuda" and num_host_blocks > 0
        block_shape = (block_size, num_kv_heads, head_dim)
        # NOTE: zero-filled, so padded (masked) reads in attention only ever see finite values
        # (a zero byte is 0 in int8 and in fp8 e4m3, and the zero scales are finite too); on
        # CPU in huge pages where the OS gives them (runtime/huge_pages.py).
        self.device_cache = zeros_huge(
            (num_layers, 2, num_blocks, *block_shape), store, self.device
        )  # [layers, 2, num_blocks, block_size, kvh, d]
        self.host_cache = torch.zeros(
            num_layers, 2, num_host_blocks, *block_shape, dtype=store, device="cpu", pin_memory=pin
        )  # [layers, 2, num_host_blocks, block_size, kvh, d]
        self.device_scales: torch.Tensor | None = None
        self.host_scales: torch.Tensor | None = None
        self.layer_caches: list[torch.Tensor] | list[QuantizedLayerCache]
        if self.quantized:
            self.device_scales = torch.zeros(
                num_layers,
                2,
                num_blocks,
                block_size,
                num_kv_heads,
                dtype=SCALE_DTYPE,
                device=self.device,
            )  # [layers, 2, num_blocks, block_size, kvh]
            self.host_scales = torch.zeros(
                num_layers,
                2,
                num_host_blocks,
                block_size,
                num_kv_heads,
                dtype=SCALE_DTYPE,
                device="cpu",
                pin_memory=pin,
            )  # [layers, 2, num_host_blocks, block_size, kvh]
            self.layer_caches = [
                QuantizedLayerCache(d, s, kv_cache_dtype)
                for d, s in zip(
                    self.device_cache.unbind(0), self.device_scales.unbind(0), strict=True
                )
            ]
        else:
            self.layer_caches = list(self.device_cache.unbind(0))

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies across all layers (K and V, scales included)."""
        num = self.device_cache[:, :, 0].numel() * self.device_cache.element_size()
        if self.device_scales is not None:
            num += self.device_scales[:, :, 0].numel() * self.device_scales.element_size()
        return num

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers (``bytes_per_block / block_size``)."""
        return self.bytes_per_block // self.block_size

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device tensor, host tensor) pairs that hold a block: data, then scales."""
        pairs = [(self.device_cache, self.host_cache)]
        if self.device_scales is not None and self.host_scales is not None:
            pairs.append((self.device_scales, self.host_scales))
        return pairs

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: ``pairs`` of (device id, host id)."""
        if not pairs:
            return
        src, dst = self._index(pairs, self.num_blocks, self.num_host_blocks, "swap_out")
        src = src.to(self.device)
        for dev, host in self._pairs():
            host.index_copy_(2, dst, dev.index_select(2, src).to("cpu"))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks: ``pairs`` of (host id, device id)."""
        if not pairs:
            return
        src, dst = self._index(pairs, self.num_host_blocks, self.num_blocks, "swap_in")
        dst = dst.to(self.device)
        for dev, host in self._pairs():
            dev.index_copy_(2, dst, host.index_select(2, src).to(self.device))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks (copy-on-write): ``pairs`` of (src id, dst id).

        All sources are read before any destination is written.
        """
        if not pairs:
            return
        src, dst = self._index(pairs, self.num_blocks, self.num_blocks, "copy_blocks")
        src, dst = src.to(self.device), dst.to(self.device)
        for dev, _ in self._pairs():
            dev.index_copy_(2, dst, dev.index_select(2, src))

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
