"""Sampler: truncation (top-k / top-p / min-p), alone and combined, against references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.runtime.sampler import Sampler
from kvserve.runtime.sampler.filters import _top_k_top_p
from kvserve.sampling_params import SamplingParams
from tests.runtime.sampler_helpers import VOCAB, make_req, random_logits


# ---------------------------------------------------------------------------- truncation
def _scaled_probs(row: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(row.double() / temperature, dim=-1)


def _top_k_set(row: torch.Tensor, k: int) -> set[int]:
    return set(torch.topk(row, k).indices.tolist())


def _top_p_set(probs: torch.Tensor, p: float, slack: float = 1e-5) -> set[int]:
    """Tokens whose strictly-more-likely mass is below p (+ slack for float rounding)."""
    order = torch.argsort(probs, descending=True)
    mass_before = torch.cumsum(probs[order], dim=0) - probs[order]
    return {int(t) for t, m in zip(order, mass_before, strict=True) if m < p + slack}


def _min_p_set(probs: torch.Tensor, min_p: float, slack: float = 1e-6) -> set[int]:
    return set(torch.nonzero(probs >= min_p * probs.max() - slack).flatten().tolist())


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.floats(0.1, 3.0),
    top_k=st.integers(1, VOCAB),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.9),
)
def test_truncation_never_emits_excluded_tokens(
    seed: int, temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    num_rows = 8
    logits = random_logits(num_rows, seed=seed)
    cases = [
        SamplingParams(temperature=temperature, top_k=top_k),
        SamplingParams(temperature=temperature, top_p=top_p),
        SamplingParams(temperature=temperature, min_p=min_p),
        SamplingParams(temperature=temperature, top_k=top_k, min_p=min_p),
    ]
    reqs = [make_req(f"r{i}", cases[i % 4], seed=seed + i if i % 2 else None) for i in range(8)]
    token_ids, _ = Sampler(VOCAB, seed=seed).sample(logits, reqs)
    for i, tok in enumerate(token_ids):
        row = logits[i]
        probs = _scaled_probs(row, temperature)
        if i % 4 == 0:
            assert tok in _top_k_set(row, top_k)
        elif i % 4 == 1:
            assert tok in _top_p_set(probs, top_p)
        elif i % 4 == 2:
            assert tok in _min_p_set(probs, min_p)
        else:
            assert tok in _top_k_set(row, top_k) and tok in _min_p_set(probs, min_p)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), top_k=st.integers(1, 8), top_p=st.floats(0.05, 0.95))
def test_top_k_with_top_p_stays_inside_both(seed: int, top_k: int, top_p: float) -> None:
    logits = random_logits(4, seed=seed)
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    reqs = [make_req(f"r{i}", params) for i in range(4)]
    token_ids, _ = Sampler(VOCAB, seed=seed).sample(logits, reqs)
    for i, tok in enumerate(token_ids):
        top = sorted(_top_k_set(logits[i], top_k))
        renorm = torch.softmax(logits[i, top].double(), dim=-1)  # top-p over the top-k only
        allowed = {top[j] for j in _top_p_set(renorm, top_p)}
        assert tok in allowed


@pytest.mark.parametrize("scale", [8.0, 0.05])  # nucleus inside the candidates / past them
def test_top_k_top_p_mask_matches_reference_on_a_large_vocab(scale: float) -> None:
    vocab = 1024
    logits = random_logits(6, vocab=vocab, seed=17) * scale
    top_ks = [vocab, vocab, 300, 40, vocab, 5]
    top_ps = [0.9, 0.5, 0.95, 1.0, 0.99, 0.7]
    _check_top_k_top_p_mask(logits, top_ks, top_ps)


def _check_top_k_top_p_mask(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> None:
    """_top_k_top_p keeps exactly the reference top-k-then-nucleus set of every row (up to
    float rounding at the top_p boundary), with the kept logits unchanged."""
    vocab = logits.shape[1]
    masked = _top_k_top_p(logits.clone(), top_ks, top_ps)
    for i in range(logits.shape[0]):
        kept = set(torch.nonzero(masked[i] > float("-inf")).flatten().tolist())
        top = sorted(_top_k_set(logits[i], top_ks[i])) if top_ks[i] < vocab else list(range(vocab))
        probs = torch.softmax(logits[i, top].double(), dim=-1)
        loose = {top[j] for j in _top_p_set(probs, top_ps[i], slack=1e-5)}
        strict = {top[j] for j in _top_p_set(probs, top_ps[i], slack=-1e-5)}
        assert strict <= kept <= loose
        assert torch.equal(masked[i, sorted(kept)], logits[i, sorted(kept)])


def _nucleus_rows(vocab: int, widths: list[int], seed: int) -> torch.Tensor:
    """[len(widths), vocab] logits whose top_p=0.9 nucleus spans about ``width`` tokens: that
    many tokens near logit 0 (shuffled through the row), the rest at -12."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.full((len(widths), vocab), -12.0)
    for i, width in enumerate(widths):
        cols = torch.randperm(vocab, generator=gen)[:width]
        rows[i, cols] = torch.randn(width, generator=gen) * 0.3
    return rows


@pytest.mark.parametrize(
    "widths",
    [
        [10, 40],  # every nucleus inside the first candidates
        [10, 1000, 40],  # one row needs the widened search
        [10, 1000, 6000],  # one row needs the whole vocabulary
        [3000, 6000, 7000],
    ],
)
def test_top_p_nucleus_wider_than_the_candidates(widths: list[int]) -> None:
    vocab = 8192
    logits = _nucleus_rows(vocab, widths, seed=len(widths) + widths[-1])
    top_ps = [0.9] * len(widths)
    _check_top_k_top_p_mask(logits, [vocab] * len(widths), top_ps)
    # The sampler draws inside each nucleus: every row truncated (the candidate path), and
    # with an untruncated row added (the masked full-vocabulary path).
    reqs = [make_req(f"r{i}", SamplingParams(temperature=1.0, top_p=0.9)) for i in widths]
    plain = make_req("plain", SamplingParams(temperature=1.0))
    with_plain = torch.cat([logits, logits[:1]])
    for seed in range(5):
        for batch, batch_reqs in ((logits, reqs), (with_plain, [*reqs, plain])):
            token_ids, _ = Sampler(vocab, seed=seed).sample(batch, batch_reqs)
            for i, tok in enumerate(token_ids[: len(widths)]):
                assert tok in _top_p_set(torch.softmax(logits[i].double(), dim=-1), 0.9)


def test_top_p_tiny_keeps_only_the_most_likely() -> None:
    logits = random_logits(6, seed=9)
    reqs = [make_req(f"r{i}", SamplingParams(temperature=1.5, top_p=1e-6)) for i in range(6)]
    token_ids, _ = Sampler(VOCAB).sample(logits, reqs)
    assert token_ids == logits.argmax(dim=-1).tolist()
