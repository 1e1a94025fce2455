"""Transparent huge pages for large CPU buffers: the KV block pool and the packed weights.

NOTE: why. Decode attention reads K/V blocks in the order the allocator gave them out, all
over a pool of hundreds of MB, and a decode step streams every weight once: with 4 KiB pages
nearly every block, and every 4 KiB of weight, is a TLB miss. Asked for 2 MiB pages
(``madvise(MADV_HUGEPAGE)`` before the first touch; Linux's default THP mode is ``madvise``,
so nothing gets them unasked), attention over a 530 MB pool and the AMX projections both
ran faster (README, "Kernels and dtype", session 10: ``bench/probes/attn_cold.py
--huge-pages``, ``bench/probes/amx_model_ab.py --huge-pages``). Where the kernel does not
give them (THP off, another OS, CUDA tensors), the buffer is an ordinary one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Sequence
from functools import lru_cache

import torch

logger = logging.getLogger("kvserve.huge_pages")

HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
_MADV_HUGEPAGE = 14  # <sys/mman.h>


@lru_cache(maxsize=1)
def _madvise() -> ctypes._CFuncPtr | None:
    """libc's ``madvise``, or None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(t: torch.Tensor) -> int:
    """Ask for huge pages over the whole 2 MiB pages inside ``t``'s storage; returns the bytes
    advised (0 when none: a CUDA tensor, under 2 MiB, not Linux, or the kernel refused).

    Call it before the memory is first written: pages already faulted in stay small.
    """
    fn = _madvise()
    if fn is None or t.device.type != "cpu":
        return 0
    start = t.data_ptr()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = (start + t.untyped_storage().nbytes()) // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return 0
    if fn(lo, hi - lo, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return 0
    return hi - lo


def zeros_huge(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape)``, on CPU in huge pages where the kernel gives them."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype)
    advise_huge_pages(t)
    return t.zero_()  # the first touch: faults the pages in (huge where advised)


def into_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of contiguous CPU ``tensors``, laid one after another (64-byte aligned) in one
    buffer that asked for huge pages; the caller drops the originals.

    NOTE: one buffer, because the weights are tensors of 0.6-57 MB: each alone holds few whole
    2 MiB pages, and padding each to them would cost ~1 MiB a tensor.
    """
    offsets, total = [], 0
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(
                "into_huge_pages takes contiguous CPU tensors, got one on "
                f"{t.device} (contiguous: {t.is_contiguous()})"
            )
        offsets.append(total)
        total += -(-t.nbytes // 64) * 64
    arena = torch.empty(total, dtype=torch.uint8)
    advise_huge_pages(arena)
    return [
        arena[off : off + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
        for t, off in zip(tensors, offsets, strict=True)
    ]
