"""The sampling defaults of ``kvserve generate`` / ``chat``: each flag given, else the model's
generation_config value, else llama.cpp's CLI default; a sampled answer prints its seed (one
stderr line); ``--temperature 0`` is greedy."""

from __future__ import annotations

import io
import re

from kvserve import cli
from kvserve.cli_sampling import LLAMA_CPP_DEFAULTS, sampling_params_from_args

SEED_LINE = re.compile(
    r"^\[kvserve\] sampling seed (\d+) \(--sampling-seed \1 repeats this answer; "
    r"--temperature 0 is greedy\)\n$"
)
QWEN_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def _params(argv: list[str], model_defaults: dict | None = None, command: str = "generate"):  # noqa: ANN202
    args = cli.build_parser(command).parse_args(
        [command, *(["hi"] if command == "generate" else []), *argv]
    )
    err = io.StringIO()
    params = sampling_params_from_args(args, model_defaults or {}, err=err)
    return params, err.getvalue()


def test_without_model_defaults_the_cli_samples_as_llama_cpp() -> None:
    params, err = _params([])
    assert LLAMA_CPP_DEFAULTS == {
        "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0
    }  # fmt: skip
    for name, value in LLAMA_CPP_DEFAULTS.items():
        assert getattr(params, name) == value, name
    assert params.max_tokens == 128 and not params.greedy
    match = SEED_LINE.match(err)
    assert match and int(match[1]) == params.seed  # the seed used, so it can be repeated
    seeds = {params.seed, *(_params([])[0].seed for _ in range(3))}
    assert len(seeds) > 1  # a random seed each run


def test_temperature_zero_is_greedy_and_prints_no_seed() -> None:
    params, err = _params(["--temperature", "0"])
    assert params.greedy and params.seed is None and err == ""


def test_a_given_seed_is_kept_and_printed() -> None:
    params, err = _params(["--sampling-seed", "1234"])
    assert params.seed == 1234 and SEED_LINE.match(err)[1] == "1234"


def test_model_defaults_replace_llama_cpps_field_by_field_and_flags_win() -> None:
    params, _ = _params([], {**QWEN_DEFAULTS, "max_tokens": 64})
    assert (params.temperature, params.top_p, params.top_k) == (0.7, 0.8, 20)
    assert params.repetition_penalty == 1.05
    assert params.min_p == 0.05  # not in the model's config: llama.cpp's
    assert params.max_tokens == 64  # the model's max_new_tokens, below the CLI's 128
    params, _ = _params(
        ["--top-k", "-1", "--temperature", "1.2", "--max-tokens", "300"], QWEN_DEFAULTS
    )
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (
        1.2,
        -1,
        0.8,
        300,
    )


def test_chat_default_max_tokens_and_model_cap() -> None:
    assert _params([], command="chat")[0].max_tokens == 256
    assert _params([], {"max_tokens": 4096}, command="chat")[0].max_tokens == 256


def test_chat_turns_take_the_seed_plus_their_number() -> None:
    params, _ = _params(["--sampling-seed", "10"], command="chat")
    assert [cli._turn_params(params, t).seed for t in range(3)] == [10, 11, 12]  # noqa: SLF001
    greedy, _ = _params(["--temperature", "0"], command="chat")
    assert cli._turn_params(greedy, 2).seed is None  # noqa: SLF001
