"""runtime/huge_pages.py: buffers that ask for transparent huge pages."""

from __future__ import annotations

import pytest
import torch

from kvserve.models.quant import quantize_dense
from kvserve.models.quant_linear import DequantDenseMethod, QuantKernelMethod
from kvserve.runtime import huge_pages
from kvserve.runtime.huge_pages import HUGE_PAGE, advise_huge_pages, into_huge_pages, zeros_huge
from kvserve.runtime.linear import M_MAX, DenseMmMethod, Linear, gather_into_huge_pages
from kvserve.runtime.native import quant_ops

CPU = torch.device("cpu")


def test_zeros_huge_is_zeros_of_the_shape_and_dtype() -> None:
    t = zeros_huge((3, 5, 7), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16
    assert t.is_contiguous() and not t.any()


def test_small_buffers_get_no_advice() -> None:
    assert advise_huge_pages(torch.empty(HUGE_PAGE // 2, dtype=torch.uint8)) == 0


class _FakeMadvise:
    """Stands in for libc's madvise: records each call, returns ``result``."""

    def __init__(self, result: int = 0) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.result = result

    def __call__(self, addr: int, length: int, advice: int) -> int:
        self.calls.append((addr, length, advice))
        return self.result


def test_the_advice_is_for_the_whole_huge_pages_inside_the_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # NOTE: the call itself, not what the OS then does with it: whether a buffer gets huge
    # pages depends on the machine (THP mode, fragmentation, memory reused from earlier
    # allocations), which a test suite cannot control; the benchmarks measure that.
    fake = _FakeMadvise()
    monkeypatch.setattr(huge_pages, "_madvise", lambda: fake)
    t = torch.empty(5 * HUGE_PAGE + 123, dtype=torch.uint8)
    n = advise_huge_pages(t)
    ((addr, length, advice),) = fake.calls
    assert advice == 14  # MADV_HUGEPAGE
    assert addr % HUGE_PAGE == 0 and length % HUGE_PAGE == 0 and length == n
    assert t.data_ptr() <= addr and addr + length <= t.data_ptr() + t.nbytes
    assert addr - t.data_ptr() < HUGE_PAGE  # no whole page left out at either end
    assert t.data_ptr() + t.nbytes - (addr + length) < HUGE_PAGE


def test_a_refused_advice_or_no_madvise_advises_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(huge_pages, "_madvise", lambda: _FakeMadvise(result=-1))
    assert advise_huge_pages(torch.empty(4 * HUGE_PAGE, dtype=torch.uint8)) == 0
    monkeypatch.setattr(huge_pages, "_madvise", lambda: None)  # not Linux
    assert advise_huge_pages(torch.empty(4 * HUGE_PAGE, dtype=torch.uint8)) == 0


def test_zeros_huge_advises_its_buffer_before_filling_it(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeMadvise()
    monkeypatch.setattr(huge_pages, "_madvise", lambda: fake)
    t = zeros_huge((8 * HUGE_PAGE // 4,), torch.float32, torch.device("cpu"))
    assert not t.any() and len(fake.calls) == 1
    addr, length, _ = fake.calls[0]
    assert t.data_ptr() <= addr < t.data_ptr() + t.nbytes and length >= 7 * HUGE_PAGE


class _Clock:
    """A clock whose every other reading (a chunk's end) is ``per_chunk`` seconds on."""

    def __init__(self, per_chunk: list[float]) -> None:
        self.per_chunk = per_chunk
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        if self.reads % 2:
            self.now += self.per_chunk[min(self.reads // 2, len(self.per_chunk) - 1)]
        self.reads += 1
        return self.now


def test_slow_huge_pages_are_given_up_for_the_rest_of_the_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chunk faulted in at under half the ordinary pages' rate (the kernel compacting memory
    for each huge page) withdraws the advice from the rest: one MADV_NOHUGEPAGE from the
    next whole huge page after that chunk to the end, and the buffer is all zeros."""
    fake = _FakeMadvise()
    monkeypatch.setattr(huge_pages, "_madvise", lambda: fake)
    monkeypatch.setattr(huge_pages, "TOUCH_CHUNK", 4 * HUGE_PAGE)
    rate = 1e9  # ordinary pages: 1 GB/s, so an 8 MiB chunk in 8.4 ms
    chunk_s = 4 * HUGE_PAGE / rate
    clock = _Clock([chunk_s, 3 * chunk_s])  # the first chunk at 1x, the second at 1/3
    t = zeros_huge(
        (20 * HUGE_PAGE // 4,), torch.float32, CPU, small_page_rate=lambda: rate, clock=clock
    )
    assert not t.any()
    assert clock.reads == 4  # two chunks timed, the rest zeroed at once
    (start, length, advice), (addr, rest, withdrawn) = fake.calls
    assert (advice, withdrawn) == (14, 15)  # MADV_HUGEPAGE, then MADV_NOHUGEPAGE
    assert addr == -(-(t.data_ptr() + 8 * HUGE_PAGE) // HUGE_PAGE) * HUGE_PAGE
    assert addr + rest == start + length  # to the end of the advised pages


def test_huge_pages_at_the_ordinary_rate_keep_their_advice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _FakeMadvise()
    monkeypatch.setattr(huge_pages, "_madvise", lambda: fake)
    monkeypatch.setattr(huge_pages, "TOUCH_CHUNK", 4 * HUGE_PAGE)
    rate = 1e9
    clock = _Clock([4 * HUGE_PAGE / rate / 1.5])  # every chunk faster than ordinary pages
    t = zeros_huge(
        (20 * HUGE_PAGE // 4,), torch.float32, CPU, small_page_rate=lambda: rate, clock=clock
    )
    assert not t.any()
    assert clock.reads == 2 * 5  # 40 MiB in five chunks of 8
    assert [c[2] for c in fake.calls] == [14]


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


@pytest.mark.skipif(not quant_ops.load(), reason=f"no quantized kernels: {quant_ops.reason()}")
def test_gathering_moves_the_quantized_blocks_and_dense_copies_in_place() -> None:
    # NOTE: in place (``Tensor.set_``): the kernel and the dense copy of one weight share its
    # ``QuantizedWeight``, and an embedding may hold it too; all of them must read the move.
    q = quantize_dense(torch.randn(40, 64), "q4_1")
    kernel, copy = QuantKernelMethod(q), DequantDenseMethod(q, torch.float32)
    lins = [
        Linear(q, [(4, kernel), (M_MAX, copy)]),
        Linear(torch.randn(24, 64), [(M_MAX, DenseMmMethod(torch.randn(64, 24).t()))]),
    ]
    x = torch.randn(6, 64)
    before = [lin(x) for lin in lins] + [lins[0](x[:3])]
    assert kernel.streamed_tensors()[0] is q.data and lins[1].methods()[0].streamed_tensors() == []
    moved = [q.data, copy.weight_t]
    assert gather_into_huge_pages(lins) == sum(t.nbytes for t in moved)
    assert kernel.weight.data is q.data  # the same tensor object, re-pointed
    assert len({t.untyped_storage().data_ptr() for t in moved}) == 1
    assert q.data.untyped_storage().data_ptr() == q.data.data_ptr()  # the buffer's first tensor
    after = [lin(x) for lin in lins] + [lins[0](x[:3])]
    for y, z in zip(before, after, strict=True):
        assert torch.equal(y, z)
    assert gather_into_huge_pages([]) == 0
