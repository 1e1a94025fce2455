"""Sampler: penalties, min_tokens, logprobs (greedy, seeds and truncation in
test_sampler_greedy.py, test_sampler_seeds.py, test_sampler_truncation.py)."""

from __future__ import annotations

import pytest
import torch

from kvserve.runtime.sampler import Sampler
from kvserve.runtime.sampler.filters import apply_penalties
from kvserve.sampling_params import SamplingParams
from tests.runtime.sampler_helpers import VOCAB, make_req, random_logits


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
