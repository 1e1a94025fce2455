"""Sampler: greedy (argmax, its fast paths and the guard's), top_k above the vocabulary,
padding columns, bad shapes."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.runtime.guard import sample_guarded
from kvserve.runtime.sampler import Sampler
from kvserve.sampling_params import SamplingParams
from tests.runtime.sampler_helpers import VOCAB, make_req, random_logits


# ------------------------------------------------------------------------------- greedy
def test_greedy_is_argmax_and_leaves_logits_untouched() -> None:
    logits = random_logits(8)
    before = logits.clone()
    reqs = [make_req(f"r{i}", SamplingParams(temperature=0.0)) for i in range(8)]
    token_ids, logprobs = Sampler(VOCAB).sample(logits, reqs)
    assert token_ids == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 8
    assert torch.equal(logits, before)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    num_rows=st.integers(1, 6),
    vocab=st.integers(1, 300),
    num_values=st.integers(1, 4),
    specials=st.lists(st.sampled_from(["nan", "inf", "-inf", "-inf row"]), max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_greedy_argmax_matches_torch_argmax_on_ties_and_non_finite_values(
    seed: int, num_rows: int, vocab: int, num_values: int, specials: list[str], dtype: torch.dtype
) -> None:
    """The greedy pick is torch.argmax's: first maximal index, NaN maximal, all -inf -> 0;
    on bf16 logits (the lm_head's output, taken as they are) as on float32."""
    gen = torch.Generator().manual_seed(seed)
    # Few distinct values: most rows have ties for the maximum.
    logits = torch.randint(0, num_values, (num_rows, vocab), generator=gen).float()  # [N, V]
    for k, special in enumerate(specials):
        row, col = k % num_rows, int(torch.randint(0, vocab, (1,), generator=gen))
        if special == "-inf row":
            logits[row] = float("-inf")
        else:
            logits[row, col] = float(special)
    logits = logits.to(dtype)
    reqs = [make_req(f"r{i}", SamplingParams(temperature=0.0)) for i in range(num_rows)]
    token_ids, _ = Sampler(vocab).sample(logits, reqs)
    assert token_ids == logits.argmax(dim=-1).tolist()


def test_bf16_logits_sample_as_their_float32_widening() -> None:
    """The runner hands the sampler the lm_head's bf16 logits: every path (the all-greedy
    argmax, a mixed batch, logprobs) gives what the same logits widened to float32 give, and
    the caller's tensor is left as it was."""
    logits = random_logits(6, seed=3).bfloat16()  # [N, V]
    logits[2, 9] = logits[2].max()  # a tie for the maximum
    before = logits.clone()
    greedy = [make_req(f"g{i}", SamplingParams(temperature=0.0, logprobs=2)) for i in range(4)]
    mixed = greedy + [
        make_req("random", SamplingParams(temperature=0.8, top_k=5, logprobs=2), seed=11),
        make_req("penalised", SamplingParams(temperature=0.0, presence_penalty=0.5)),
    ]
    for reqs in (greedy, mixed):
        rows = logits[: len(reqs)]
        assert Sampler(VOCAB).sample(rows, reqs) == Sampler(VOCAB).sample(rows.float(), reqs)
    assert Sampler(VOCAB).sample(logits[:4], greedy)[0] == logits[:4].float().argmax(-1).tolist()
    assert torch.equal(logits, before)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_logprobs=st.sampled_from([None, 0, 3]))
def test_greedy_fast_path_matches_the_general_path(seed: int, num_logprobs: int | None) -> None:
    """An all-greedy batch (one argmax) picks the same tokens and logprobs as the same greedy
    rows sampled inside a batch that takes the general path (a random and a penalised row)."""
    num_greedy = 5
    logits = random_logits(num_greedy + 2, seed=seed)
    logits[1, 7] = logits[1].max()  # a tie for the maximum
    greedy = [
        make_req(f"g{i}", SamplingParams(temperature=0.0, logprobs=num_logprobs))
        for i in range(num_greedy)
    ]
    others = [
        make_req("random", SamplingParams(temperature=0.9, logprobs=num_logprobs), seed=seed),
        make_req("penalised", SamplingParams(temperature=0.0, repetition_penalty=1.5)),
    ]
    fast_ids, fast_lps = Sampler(VOCAB).sample(logits[:num_greedy], greedy)
    mixed_ids, mixed_lps = Sampler(VOCAB).sample(logits, greedy + others)
    assert fast_ids == mixed_ids[:num_greedy]
    assert fast_ids == logits[:num_greedy].argmax(dim=-1).tolist()
    assert fast_lps == mixed_lps[:num_greedy]
    if num_logprobs is None:
        assert fast_lps == [None] * num_greedy
    else:
        assert all(e is not None and fast_ids[i] in e for i, e in enumerate(fast_lps))


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    num_logprobs=st.sampled_from([None, 2]),
    bad=st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["nan", "inf", "-inf"])), max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_guard_greedy_fast_path_matches_the_checked_general_path(
    seed: int,
    num_logprobs: int | None,
    bad: list[tuple[int, str]],
    dtype: torch.dtype,
) -> None:
    """``sample_guarded`` on an all-greedy batch finds the non-finite rows in the argmax's own
    pass (``Sampler.sample_greedy_checked``): the same ids, logprobs and failures as the
    general path (a sum over the logits, then ``Sampler.sample`` on the finite rows). A
    non-finite value past the vocabulary (a padding column) fails nothing."""
    logits = random_logits(6, VOCAB + 3, seed=seed).to(dtype)  # [6, V + 3 padding columns]
    logits[0, VOCAB + 1] = float("nan")
    for row, value in bad:
        logits[row, (seed + row) % VOCAB] = float(value)
    reqs = [
        make_req(f"r{i}", SamplingParams(temperature=0.0, logprobs=num_logprobs)) for i in range(6)
    ]
    sampler = Sampler(VOCAB)
    assert sampler.sample_greedy_checked(logits, reqs) is not None  # the fast path applies
    fast = sample_guarded(sampler, logits, reqs)
    with mock.patch.object(Sampler, "sample_greedy_checked", return_value=None):
        general = sample_guarded(sampler, logits, reqs)
    assert fast == general
    expected_bad = {f"r{row}" for row, _ in bad}
    assert set(fast[2]) == expected_bad
    assert set(fast[0]) == {f"r{i}" for i in range(6)} - expected_bad


def test_guard_greedy_fast_path_falls_back_when_it_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = random_logits(3)
    logits[2, 4] = float("inf")
    reqs = [make_req(f"r{i}", SamplingParams(temperature=0.0)) for i in range(3)]

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("fast path broke")

    monkeypatch.setattr(Sampler, "sample_greedy_checked", boom)
    ids, _, failed = sample_guarded(Sampler(VOCAB), logits, reqs)
    assert ids == {f"r{i}": logits[i].argmax().item() for i in range(2)}
    assert failed == {"r2": "the model produced non-finite logits"}


def test_greedy_checked_leaves_other_batches_to_the_general_path() -> None:
    logits = random_logits(2)
    greedy = make_req("g", SamplingParams(temperature=0.0))
    assert Sampler(VOCAB).sample_greedy_checked(logits, [greedy, greedy]) is not None
    for other in (
        make_req("t", SamplingParams(temperature=0.7)),
        make_req("p", SamplingParams(temperature=0.0, repetition_penalty=1.3)),
        make_req("b", SamplingParams(temperature=0.0, logit_bias={3: 5.0})),
    ):
        assert Sampler(VOCAB).sample_greedy_checked(logits, [greedy, other]) is None


def test_top_k_one_is_greedy_inside_a_mixed_batch() -> None:
    logits = random_logits(4, seed=1)
    before = logits.clone()
    reqs = [
        make_req("a", SamplingParams(temperature=1.0, top_k=1)),
        make_req("b", SamplingParams(temperature=0.7)),
        make_req("c", SamplingParams(temperature=0.0)),
        make_req("d", SamplingParams(temperature=1.0, top_p=0.5)),
    ]
    token_ids, _ = Sampler(VOCAB).sample(logits, reqs)
    argmax = logits.argmax(dim=-1).tolist()
    assert token_ids[0] == argmax[0] and token_ids[2] == argmax[2]
    assert torch.equal(logits, before)


@pytest.mark.parametrize("with_truncated_row", [False, True])
def test_top_k_above_the_vocabulary_is_no_restriction(with_truncated_row: bool) -> None:
    """top_k > vocab (accepted, as vLLM) draws exactly what top_k disabled draws, seeded or
    not, alone or next to a row that is truncated (the candidate path)."""
    logits = random_logits(6, seed=4)

    def draws(top_k: int) -> list[list[int]]:
        sampler = Sampler(VOCAB, seed=9)
        out = []
        for pos in range(40):  # 40 draws per row: a seeded row's draw depends on its position
            reqs = [
                make_req(f"r{i}", SamplingParams(temperature=1.3, top_k=top_k),
                         output=[0] * pos, seed=100 + i if i % 2 else None)
                for i in range(5)
            ]  # fmt: skip
            if with_truncated_row:
                reqs.append(make_req("k", SamplingParams(temperature=1.3, top_k=3), seed=7))
            out.append(sampler.sample(logits[: len(reqs)], reqs)[0])
        return out

    disabled = draws(-1)
    assert len({t for row in disabled for t in row[:5]}) > 10  # really sampled, not argmax
    assert draws(VOCAB + 1000) == disabled == draws(VOCAB) == draws(0)


def test_padding_columns_past_vocab_are_never_sampled() -> None:
    logits = torch.zeros((4, VOCAB + 8))
    logits[:, VOCAB:] = 100.0  # padding columns look most likely
    reqs = [
        make_req("g", SamplingParams(temperature=0.0)),
        make_req("r", SamplingParams(temperature=1.0)),
        make_req("s", SamplingParams(temperature=2.0), seed=3),
        make_req("p", SamplingParams(temperature=0.0, repetition_penalty=1.5), output=[4]),
    ]
    token_ids, _ = Sampler(VOCAB).sample(logits, reqs)
    assert all(0 <= t < VOCAB for t in token_ids)


def test_bad_shapes_raise() -> None:
    sampler = Sampler(VOCAB)
    req = make_req("a", SamplingParams())
    with pytest.raises(ValueError, match="len\\(reqs\\)"):
        sampler.sample(random_logits(2), [req])
    with pytest.raises(ValueError, match="vocab_size"):
        sampler.sample(torch.zeros((1, VOCAB - 1)), [req])
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler(0)
