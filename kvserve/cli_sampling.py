"""The sampling flags of ``kvserve generate`` and ``kvserve chat``, and their defaults.

A flag left out takes the model's default (``--generation-config``: its
generation_config.json, or a GGUF's ``general.sampling.*`` keys), else llama.cpp's CLI
default (``LLAMA_CPP_DEFAULTS``), field by field as llama.cpp applies a GGUF's keys.
``--temperature 0`` is greedy. A sampled answer prints its seed (stderr, one line), so
``--sampling-seed`` repeats it. The OpenAI API keeps OpenAI's defaults (temperature 1.0,
``kvserve/server/validation.py``).
"""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from kvserve.sampling_params import SamplingParams

# NOTE: llama.cpp's CLI defaults (common/common.h, common_params_sampling: temp 0.80, top_k
# 40, top_p 0.95, min_p 0.05, repeat_penalty 1.00). Greedy decoding, this CLI's default
# before, loops on the embedded 4-bit 135M model ("What is the capital of France?").
LLAMA_CPP_DEFAULTS: dict[str, float] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "repetition_penalty": 1.0,
}
SAMPLING_FLAGS = tuple(LLAMA_CPP_DEFAULTS)  # the flags whose default is the model's
_SEED_BOUND = 1 << 31  # printed seeds stay short enough to retype


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    """The sampling flags; those in ``SAMPLING_FLAGS`` and ``--max-tokens`` default to None
    (resolved by ``sampling_params_from_args`` once the model's defaults are known)."""
    g = p.add_argument_group(
        "sampling (a flag left out takes the model's generation_config value, else llama.cpp's "
        "default)"
    )
    g.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"tokens to generate (default {max_tokens}, or the model's max_new_tokens if less)",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 is greedy (the same text every run); default 0.8 (llama.cpp's; the API's is 1.0)",
    )
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default 0.95)")
    g.add_argument(
        "--top-k", type=int, default=None, help="keep the k most likely (default 40; -1: all)"
    )
    g.add_argument(
        "--min-p", type=float, default=None, help="drop tokens below min_p x the top one (0.05)"
    )
    g.add_argument(
        "--presence-penalty", type=float, default=0.0, help="-2..2, on tokens already generated"
    )
    g.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="-2..2, by how often they were"
    )
    g.add_argument(
        "--repetition-penalty", type=float, default=None, help=">1 discourages repeats (default 1)"
    )
    g.add_argument(
        "--sampling-seed",
        dest="sample_seed",
        type=int,
        default=None,
        help="sampling seed (default: a random one, printed on stderr)",
    )
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-text")
    p.set_defaults(default_max_tokens=max_tokens)


def sampling_params_from_args(
    args: argparse.Namespace,
    model_defaults: Mapping[str, Any],
    err: TextIO | None = None,
    **overrides: object,
) -> SamplingParams:
    """The SamplingParams of ``args``: each flag given, else ``model_defaults`` (the engine's
    ``generation_defaults.values``), else llama.cpp's. A sampled (not greedy) request without
    ``--sampling-seed`` gets a random seed; the seed of a sampled request is printed on
    ``err`` (default stderr) as one line."""
    from kvserve.sampling_params import SamplingParams

    values: dict[str, Any] = {}
    for name in SAMPLING_FLAGS:
        given = getattr(args, name)
        values[name] = (
            given if given is not None else model_defaults.get(name, LLAMA_CPP_DEFAULTS[name])
        )
    values["top_k"] = int(values["top_k"])
    max_tokens = args.max_tokens
    if max_tokens is None:
        model_max = model_defaults.get("max_tokens")
        max_tokens = (
            args.default_max_tokens
            if model_max is None
            else min(args.default_max_tokens, model_max)
        )
    values.update(
        max_tokens=max_tokens,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.sample_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    values.update(overrides)
    params = SamplingParams(**values)
    if params.greedy:
        return params
    if params.seed is None:
        params = SamplingParams(**{**values, "seed": secrets.randbelow(_SEED_BOUND)})
    print(
        f"[kvserve] sampling seed {params.seed} (--sampling-seed {params.seed} repeats this "
        "answer; --temperature 0 is greedy)",
        file=err or sys.stderr,
    )
    return params
