"""Workspace: reusable activation buffers for one model's forward pass (see ``Workspace``)."""

from __future__ import annotations

import math

import torch

from kvserve.runtime.linear import row_bucket


class Workspace:
    """Reusable activation buffers for the forward pass, one per role, grown on demand.

    A buffer is reallocated only when a step needs more elements than it holds (or another
    dtype/device), so after the largest step has run once, steps allocate nothing here.
    NOTE: every layer reuses the same buffers: a view handed out is valid only until the next
    ``take`` of that role. Tensors that leave the model (its output) never live here.
    Repeated ``take`` calls with the same shape return the same view object (no tensor ops):
    callers must not change its metadata in place (``resize_``, ``t_``, ...).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        # Last view handed out per role: (shape, dtype, device, view).
        self._views: dict[str, tuple[tuple[int, ...], torch.dtype, torch.device, torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def take(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A contiguous ``shape`` view of role ``name``'s buffer (contents undefined)."""
        hit = self._views.get(name)
        if hit is not None and hit[0] == shape and hit[1] == dtype and hit[2] == device:
            return hit[3]
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            # NOTE: room for the rows a padded kernel call reads and writes (``row_bucket``),
            # so ``Linear`` pads in place instead of copying; zeros, so that those rows hold
            # zeros or an earlier step's values, never arbitrary bits (denormals, NaN).
            padded = row_bucket(shape[0]) * (numel // shape[0]) if shape and shape[0] else numel
            buf = torch.zeros(padded, dtype=dtype, device=device)
            self._buffers[name] = buf
        view = buf[:numel].view(shape)
        self._views[name] = (tuple(shape), dtype, device, view)
        return view

    def constant(self, value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 0-dim tensor holding ``value``, made once.

        NOTE: an in-place op with a Python number wraps it in a fresh 0-dim tensor on every
        call; a cached one avoids that allocation.
        """
        key = f"const:{value!r}"
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != dtype or buf.device != device:
            buf = torch.tensor(value, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf

    def like(self, name: str, shape: tuple[int, ...], ref: torch.Tensor) -> torch.Tensor:
        """``take`` with ``ref``'s dtype and device."""
        return self.take(name, shape, ref.dtype, ref.device)
