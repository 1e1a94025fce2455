"""The greedy argmax with its finiteness check where the logits live (a GPU's path, checked
here on CPU tensors): the same ids and flags as ``torch.argmax`` / ``torch.isfinite``."""

from __future__ import annotations

import pytest
import torch

from kvserve.runtime.sampler.greedy import device_argmax_checked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_argmax_checked_matches_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=gen).to(dtype)
    logits[1, 7] = float("nan")
    logits[2, 9] = float("inf")
    logits[3, 11] = float("-inf")
    logits[4] = 0.0  # all tied
    ids, finite = device_argmax_checked(logits)
    assert ids.device.type == "cpu" and ids.dtype == torch.long and finite.dtype == torch.bool
    assert finite.tolist() == [True, False, False, False, True, True]
    good = [0, 4, 5]
    assert ids[good].tolist() == logits[good].float().argmax(dim=-1).tolist()
    assert ids[1].item() == 7 and ids[2].item() == 9  # NaN and +inf count as maximal


def test_device_argmax_checked_takes_a_strided_vocab_slice() -> None:
    """The sampler passes ``logits[:, :vocab_size]`` of a padded lm_head output."""
    logits = torch.randn(3, 130)
    logits[:, 128:] = 1e4  # padding columns past the vocabulary: never picked
    ids, finite = device_argmax_checked(logits[:, :128])
    assert ids.tolist() == logits[:, :128].argmax(dim=-1).tolist()
    assert finite.all()
