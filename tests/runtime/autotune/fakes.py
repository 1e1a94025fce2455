"""Fake kernels, factories and timers for the autotune tests."""

from __future__ import annotations

import torch

from kvserve.runtime.linear import LinearMethod

CPU = torch.device("cpu")

SHAPES = [(24, 16), (16, 40)]


class FakeMethod(LinearMethod):
    """Correct math (``x @ w.t()``), a name, and a cost the fake timer reads."""

    def __init__(self, weight: torch.Tensor, name: str, *, shares: bool = True) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.name = name
        self.shares_source = shares

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.mm(x, self.weight.t(), out=out)


class RaisingMethod(FakeMethod):
    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        raise RuntimeError("no kernel for this shape")


def fake_factory(source, *, act_dtype, device):  # type: ignore[no-untyped-def]
    return [FakeMethod(source, "small"), FakeMethod(source, "big", shares=False)]


def raising_factory(source, *, act_dtype, device):  # type: ignore[no-untyped-def]
    raise ImportError("library missing")


def broken_method_factory(source, *, act_dtype, device):  # type: ignore[no-untyped-def]
    return [RaisingMethod(source, "broken")]


def fake_timer(calls: list[str] | None = None):  # type: ignore[no-untyped-def]
    """ "small" wins up to M=8, "big" above (by far more than the margin)."""

    def timer(method: LinearMethod, x: torch.Tensor, out: torch.Tensor) -> float:
        if calls is not None:
            calls.append(method.name)
        m = x.shape[0]
        if method.name == "small":
            return 1e-6 * m
        return 1e-5 + 1e-8 * m

    return timer


class LazyCopyMethod(FakeMethod):
    """Holds a copy made by ``prepare`` (as the prepacked methods do); ``fail`` makes it raise."""

    fail = False

    def __init__(self, weight: torch.Tensor, name: str) -> None:
        super().__init__(weight, name, shares=False)
        self.prepared = False

    def prepare(self) -> None:
        if self.fail:
            raise RuntimeError("no room for the copy")
        self.prepared = True

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if not self.prepared:  # as the real ones: made on the first call if not before
            self.prepare()
        return super().apply(x, out)
