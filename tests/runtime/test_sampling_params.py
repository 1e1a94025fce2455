"""SamplingParams validation: every bad value raises ValueError naming its field."""

from __future__ import annotations

import math

import pytest

from kvserve.sampling_params import MAX_LOGPROBS, SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 129),
        ("n", True),
        ("n", 1.0),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "1"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.0),
        ("top_k", True),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("seed", 1.5),
        ("seed", False),
        ("max_tokens", 0),
        ("max_tokens", 2.0),
        ("min_tokens", -1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.inf),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("logprobs", -1),
        ("logprobs", MAX_LOGPROBS + 1),
        ("logprobs", True),
        ("prompt_logprobs", MAX_LOGPROBS + 1),
        ("stop", [""]),
        ("stop", [1]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", 7),
        ("extra_stop", ("",)),
        ("extra_stop", ["<|im_end|>"]),
        ("include_stop_str_in_output", 1),
        ("ignore_eos", "yes"),
        ("skip_special_tokens", None),
    ],
)
def test_invalid_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**{field: value})


def test_min_tokens_must_not_exceed_max_tokens() -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.min_tokens must not exceed"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=50, max_tokens=None).min_tokens == 50


def test_defaults_and_normalisation() -> None:
    params = SamplingParams()
    assert params.n == 1 and params.max_tokens == 16 and not params.greedy
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    both = SamplingParams(stop=["a"], extra_stop=("<|im_end|>",))
    assert both.all_stop_strings == ["a", "<|im_end|>"]
    assert SamplingParams().all_stop_strings == []


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 1e-6}, True),
        ({"temperature": 0.5, "top_k": 1}, True),
        ({"temperature": 0.5}, False),
        ({"temperature": 0.5, "top_k": 2}, False),
    ],
)
def test_greedy(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).greedy is greedy
