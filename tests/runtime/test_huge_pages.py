"""runtime/huge_pages.py: buffers that ask for transparent huge pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.runtime.huge_pages import HUGE_PAGE, advise_huge_pages, into_huge_pages, zeros_huge

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kb() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_zeros_huge_is_zeros_of_the_shape_and_dtype() -> None:
    t = zeros_huge((3, 5, 7), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16
    assert t.is_contiguous() and not t.any()


def test_small_buffers_get_no_advice() -> None:
    assert advise_huge_pages(torch.empty(HUGE_PAGE // 2, dtype=torch.uint8)) == 0


def test_advice_covers_the_whole_huge_pages_inside() -> None:
    t = torch.empty(5 * HUGE_PAGE, dtype=torch.uint8)
    n = advise_huge_pages(t)
    if n:  # Linux: every whole 2 MiB page inside the buffer
        assert n % HUGE_PAGE == 0 and 4 * HUGE_PAGE <= n <= 5 * HUGE_PAGE


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)
def test_zeros_huge_faults_in_huge_pages() -> None:
    before = _anon_huge_kb()
    # NOTE: 64 MiB, above glibc's largest mmap threshold (32 MiB), so the buffer is a fresh
    # mapping: a smaller one may reuse memory that earlier tests already faulted in, which
    # stays in small pages. The kernel may still fall back to small pages (fragmented
    # memory); most of a fresh buffer comes in huge pages on an ordinary machine.
    t = zeros_huge((32 * HUGE_PAGE // 4,), torch.float32, torch.device("cpu"))
    assert _anon_huge_kb() - before >= 16 * HUGE_PAGE // 1024
    del t


def test_into_huge_pages_copies_exactly_and_aligned() -> None:
    ts = [torch.randn(3, 5), torch.arange(7, dtype=torch.int32), torch.randn(2, 9).bfloat16()]
    out = into_huge_pages(ts)
    for a, b in zip(ts, out, strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
        assert b.data_ptr() % 64 == 0
    assert len({b.untyped_storage().data_ptr() for b in out}) == 1  # one buffer
    ts[0].zero_()
    assert out[0].any()  # copies, not views of the originals


def test_into_huge_pages_rejects_non_contiguous() -> None:
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        into_huge_pages([torch.randn(4, 4).t()])
