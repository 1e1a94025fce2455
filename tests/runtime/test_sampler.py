"""Sampler: greedy, seeds, truncation (top-k / top-p / min-p), penalties, min_tokens, logprobs."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.outputs import ScheduledRequest
from kvserve.runtime.guard import sample_guarded
from kvserve.runtime.sampler import Sampler, seeded_uniform
from kvserve.runtime.sampler.filters import _top_k_top_p, apply_penalties
from kvserve.sampling_params import SamplingParams

VOCAB = 64


def make_req(
    request_id: str,
    params: SamplingParams,
    *,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
) -> ScheduledRequest:
    """A ScheduledRequest that samples this step."""
    prompt = [1, 2, 3] if prompt is None else prompt
    return ScheduledRequest(
        request_id=request_id,
        token_ids=[prompt[-1]],
        start_pos=len(prompt) - 1,
        block_ids=[0],
        sample=True,
        sampling_params=params,
        prompt_token_ids=prompt,
        output_token_ids=[] if output is None else output,
        seed=seed,
    )


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((num_rows, vocab), generator=gen) * 3.0  # [N, V]


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


# ------------------------------------------------------------------------------- seeds
def _run_seeded(batch_builder, num_steps: int = 6) -> list[int]:
    """Sample num_steps tokens for request 'target' (seed 7) inside varying batches."""
    sampler = Sampler(VOCAB, seed=123)
    tokens: list[int] = []
    params = SamplingParams(temperature=1.0)
    for step in range(num_steps):
        target = make_req("target", params, output=list(tokens), seed=7)
        reqs, row = batch_builder(step, target)
        logits = random_logits(len(reqs), seed=1000 + step)
        logits[row] = random_logits(1, seed=step)[0]  # the target's logits depend on step only
        token_ids, _ = sampler.sample(logits, reqs)
        tokens.append(token_ids[row])
    return tokens


def test_seeded_request_is_reproducible_across_batch_compositions() -> None:
    def alone(step, target):
        return [target], 0

    def mixed(step, target):
        others = [
            make_req(f"u{step}", SamplingParams(temperature=1.3)),
            make_req("other-seeded", SamplingParams(temperature=0.9, top_p=0.8), seed=99),
            make_req(f"g{step}", SamplingParams(temperature=0.0)),
        ]
        row = step % 4
        return others[:row] + [target] + others[row:], row

    first = _run_seeded(alone)
    assert _run_seeded(alone) == first
    assert _run_seeded(mixed) == first


def test_different_seeds_and_stateless_draws() -> None:
    logits = torch.zeros((1, 1000))  # uniform: every draw depends only on the noise
    params = SamplingParams(temperature=1.0)
    sampler = Sampler(1000)

    def draws(request_id: str, seed: int, num: int = 6) -> list[int]:
        out: list[int] = []
        for _ in range(num):
            req = make_req(request_id, params, output=list(out), seed=seed)
            out.append(sampler.sample(logits, [req])[0][0])
        return out

    a, b = draws("a", 1), draws("b", 2)
    assert a != b
    assert len(set(a)) > 1  # each output position draws a new number
    # Drawing again (a step re-run after a fault, another request id, a fresh sampler) for
    # the same (seed, position) gives the same token: no state advances between draws.
    assert draws("a", 1) == a and draws("other-id", 1) == a
    assert [Sampler(1000).sample(logits, [make_req("a", params, seed=1)])[0][0]] == a[:1]
    failed_attempt = make_req("a", params, output=a[:3], seed=1)
    sampler.sample(logits, [failed_attempt])
    assert sampler.sample(logits, [failed_attempt])[0] == [a[3]]


def test_seeded_uniform_is_uniform_and_position_dependent() -> None:
    values = [seeded_uniform(seed, pos) for seed in range(-3, 40) for pos in range(50)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert len(set(values)) == len(values)
    mean = sum(values) / len(values)
    assert abs(mean - 0.5) < 0.02  # 2,150 draws: the standard error is 0.006
    deciles = [sum(int(v * 10) == d for v in values) for d in range(10)]
    assert min(deciles) > 150 and max(deciles) < 280  # 215 expected per decile


def test_unseeded_requests_follow_the_sampler_seed() -> None:
    logits = torch.zeros((5, 1000))  # uniform: the draw depends only on the generator
    reqs = [make_req(f"r{i}", SamplingParams(temperature=1.0)) for i in range(5)]
    runs = [Sampler(1000, seed=s).sample(logits, reqs)[0] for s in (11, 11, 12)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize("top_k", [-1, 3])  # full-vocabulary draw / draw among candidates
def test_sample_frequencies_match_softmax(top_k: int) -> None:
    """Token i is drawn with probability softmax(logits / T)[i] (renormalised over top-k)."""
    base = torch.tensor([1.0, 0.0, -1.0, 0.5])
    num_rows = 6000
    logits = base.expand(num_rows, 4).clone()  # [num_rows, 4]
    params = SamplingParams(temperature=0.8, top_k=top_k)
    reqs = [make_req(f"r{i}", params, seed=i if i % 3 == 0 else None) for i in range(num_rows)]
    token_ids, _ = Sampler(4, seed=5).sample(logits, reqs)
    counts = torch.bincount(torch.tensor(token_ids), minlength=4).double() / num_rows
    scaled = base.double() / 0.8
    if top_k > 0:
        scaled[2] = float("-inf")  # the least likely token is outside the top 3
    expected = torch.softmax(scaled, dim=-1)
    assert torch.allclose(counts, expected, atol=0.025), (counts, expected)


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


# ------------------------------------------------------------------------------ penalties
def test_repetition_penalty_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -2.0]])
    req = make_req("a", SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1, 1, 3])
    out = apply_penalties(logits, [req])
    # Seen tokens 0, 1, 3: positive logits divided by 2, negative multiplied by 2.
    assert torch.allclose(out, torch.tensor([[1.0, -2.0, 0.5, 0.5, -2.0]]))


def test_presence_and_frequency_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -2.0]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    req = make_req("a", params, prompt=[0, 2], output=[1, 1, 3])
    out = apply_penalties(logits, [req])
    # Output counts: token 1 twice, token 3 once; prompt tokens are not penalised.
    expected = torch.tensor([[2.0, -1.0 - 0.5 - 0.5, 0.5, 1.0 - 0.5 - 0.25, -2.0]])
    assert torch.allclose(out, expected)


def test_penalties_change_the_greedy_choice_per_row() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0], [3.0, 2.0, 0.0, 0.0]])
    reqs = [
        make_req("pen", SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[0]),
        make_req("plain", SamplingParams(temperature=0.0), prompt=[0]),
    ]
    token_ids, _ = Sampler(4).sample(logits, reqs)
    assert token_ids == [1, 0]  # 3.0 / 2 = 1.5 < 2.0 for the penalised row only


# ------------------------------------------------------------------------------ min_tokens
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_eos_and_stop_ids(temperature: float) -> None:
    eos, stop_id = 5, 6
    logits = torch.full((1, 8), -20.0)
    logits[0, eos], logits[0, stop_id], logits[0, 3] = 40.0, 20.0, 0.0
    sampler = Sampler(8, eos_token_id=eos)
    params = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[stop_id])

    def pick(output: list[int], p: SamplingParams = params) -> int:
        return sampler.sample(logits, [make_req("a", p, output=output)])[0][0]

    assert pick([]) == 3
    assert pick([3, 3]) == 3
    assert pick([3, 3, 3]) == eos  # min_tokens reached
    ignore = SamplingParams(
        temperature=temperature, min_tokens=3, stop_token_ids=[stop_id], ignore_eos=True
    )
    assert pick([], ignore) == eos  # eos does not stop, so it is not masked


# ------------------------------------------------------------------------------- logprobs
def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    logits = random_logits(3, seed=21)
    reqs = [
        make_req("top5", SamplingParams(temperature=0.0, logprobs=5)),
        make_req("chosen", SamplingParams(temperature=2.0, logprobs=0), seed=1),
        make_req("none", SamplingParams(temperature=0.0)),
    ]
    token_ids, entries = Sampler(VOCAB).sample(logits, reqs)
    ref = torch.log_softmax(logits.double(), dim=-1)  # before temperature
    top5 = entries[0]
    assert top5 is not None and len(top5) == 5
    expected_ids = torch.topk(ref[0], 5).indices.tolist()
    assert list(top5) == expected_ids  # sampled (argmax) first, then the rest by rank
    for rank, tid in enumerate(expected_ids, start=1):
        assert top5[tid].rank == rank
        assert top5[tid].logprob == pytest.approx(float(ref[0, tid]), abs=1e-5)
    chosen = entries[1]
    assert chosen is not None and list(chosen) == [token_ids[1]]
    lp = chosen[token_ids[1]]
    assert lp.logprob == pytest.approx(float(ref[1, token_ids[1]]), abs=1e-5)
    assert lp.rank == int((ref[1] > ref[1, token_ids[1]]).sum()) + 1
    assert entries[2] is None


def test_logprobs_include_a_sampled_token_outside_the_top_n() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    req = make_req("a", SamplingParams(temperature=0.0, logprobs=1, min_tokens=1))
    token_ids, entries = Sampler(4, eos_token_id=0).sample(logits, [req])
    assert token_ids == [1]  # eos (0) masked by min_tokens
    entry = entries[0]
    assert entry is not None and set(entry) == {0, 1}
    assert entry[1].rank == 2 and entry[0].rank == 1
