"""Transparent huge pages for large CPU buffers: the KV block pool and the packed weights.

NOTE: why. Decode attention reads K/V blocks in the order the allocator gave them out, all
over a pool of hundreds of MB, and a decode step streams every weight once: with 4 KiB pages
nearly every block, and every 4 KiB of weight, is a TLB miss. Asked for 2 MiB pages
(``madvise(MADV_HUGEPAGE)`` before the first touch; Linux's default THP mode is ``madvise``,
so nothing gets them unasked), attention over a 530 MB pool and the AMX projections both
ran faster (docs/kernels-rationale.md, section 10: the AMX Xeon, 2026-12-02, 6778ddc; the
probes ``bench/probes/attn_cold.py`` and ``amx_model_ab.py --huge-pages``, at 25ace60). Where
the kernel does not give them (THP off, another OS, CUDA tensors), the buffer is an ordinary
one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import time
from collections.abc import Callable, Sequence
from functools import lru_cache

import torch

logger = logging.getLogger("kvserve.huge_pages")

HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
_MADV_HUGEPAGE = 14  # <sys/mman.h>
_MADV_NOHUGEPAGE = 15
# Bytes a large buffer's first touch writes between two looks at the clock (zeros_huge).
TOUCH_CHUNK = 64 << 20


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


def _huge_range(t: torch.Tensor, offset: int = 0) -> tuple[int, int]:
    """[lo, hi): the whole 2 MiB pages of ``t``'s storage from byte ``offset`` on."""
    start = t.data_ptr()
    lo = -(-(start + offset) // HUGE_PAGE) * HUGE_PAGE
    hi = (start + t.untyped_storage().nbytes()) // HUGE_PAGE * HUGE_PAGE
    return lo, hi


def advise_huge_pages(t: torch.Tensor) -> int:
    """Ask for huge pages over the whole 2 MiB pages inside ``t``'s storage; returns the bytes
    advised (0 when none: a CUDA tensor, under 2 MiB, not Linux, or the kernel refused).

    Call it before the memory is first written: pages already faulted in stay small.
    """
    fn = _madvise()
    if fn is None or t.device.type != "cpu":
        return 0
    lo, hi = _huge_range(t)
    if hi <= lo:
        return 0
    if fn(lo, hi - lo, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return 0
    return hi - lo


def first_touch_rate(nbytes: int = TOUCH_CHUNK) -> float:
    """Bytes a second that writing fresh memory in ordinary (4 KiB) pages runs at now."""
    t0 = time.perf_counter()
    torch.empty(nbytes, dtype=torch.uint8).zero_()
    return nbytes / max(time.perf_counter() - t0, 1e-9)


def zeros_huge(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    *,
    small_page_rate: Callable[[], float] = first_touch_rate,
    clock: Callable[[], float] = time.perf_counter,
) -> torch.Tensor:
    """``torch.zeros(shape)``, on CPU in huge pages where the kernel gives them quickly.

    The first touch faults the pages in, ``TOUCH_CHUNK`` bytes at a time. When a chunk came in
    at under half the rate of ordinary pages (``small_page_rate``), the rest of the buffer
    withdraws its advice and takes ordinary pages.

    NOTE: why. Under THP's default ``defrag`` setting (``madvise``) the kernel compacts memory
    to make each huge page of an advised region when none is free: a 2.3 GiB buffer took 14.5 s
    to fault in on a fragmented host, 0.6 s in 4 KiB pages and 0.5 s in huge pages when free
    (the Xeon without AMX, 2026-12-03, cd84d74: the probe ``bench/probes/first_touch.py`` at
    25ace60; docs/memory.md), and every start-up paid it. Huge pages gain a few per cent on
    decode; not a start-up twenty times as long.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype)
    if advise_huge_pages(t) == 0 or t.nbytes <= 2 * TOUCH_CHUNK:
        return t.zero_()  # the first touch: faults the pages in (huge where advised)
    flat = t.view(-1).view(torch.uint8)  # the buffer's bytes
    floor = small_page_rate() / 2
    done = 0
    while done < flat.numel():
        chunk = flat[done : done + TOUCH_CHUNK]
        t0 = clock()
        chunk.zero_()
        rate = chunk.numel() / max(clock() - t0, 1e-9)
        done += chunk.numel()
        if rate < floor and done < flat.numel():
            _withdraw_advice(t, done)
            logger.info(
                "huge pages came in at %.2f GB/s (ordinary pages: %.2f): the last %.0f MiB of "
                "a %.0f MiB buffer take ordinary pages",
                rate / 1e9,
                2 * floor / 1e9,
                (flat.numel() - done) / 2**20,
                flat.numel() / 2**20,
            )
            flat[done:].zero_()
            break
    return t


def _withdraw_advice(t: torch.Tensor, offset: int) -> None:
    """``madvise(MADV_NOHUGEPAGE)`` over ``t``'s whole 2 MiB pages from byte ``offset`` on."""
    fn = _madvise()
    lo, hi = _huge_range(t, offset)
    if fn is not None and hi > lo and fn(lo, hi - lo, _MADV_NOHUGEPAGE) != 0:
        logger.debug("madvise(MADV_NOHUGEPAGE) refused: errno %d", ctypes.get_errno())


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
