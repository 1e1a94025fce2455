"""``kvserve bench first-token``: the greedy answer and each step's top-5 log-probabilities,
per weight setting, to see how near a tie the first tokens are.

A setting is ``quantization:dtype``. ``auto`` runs a GGUF's quantized blocks as stored (on the
int8-dot kernels, whose int8 activations round); ``none`` dequantizes the weights at load.
Where two settings answer differently, the first step whose top tokens trade places shows
how near the tie was: a small model's answer can turn on a few hundredths of a nat.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

DEFAULT_SETTINGS = ("none:float32", "auto:float32", "auto:bfloat16")


def parse_setting(text: str) -> tuple[str, str]:
    """``"auto:bfloat16"`` -> ``("auto", "bfloat16")``; a clear error for anything else."""
    quantization, sep, dtype = text.partition(":")
    if not sep or not quantization or not dtype:
        raise argparse.ArgumentTypeError(
            f"--settings: {text!r} is not QUANTIZATION:DTYPE (e.g. auto:bfloat16)"
        )
    return quantization, dtype


def first_tokens(
    model: str | None,
    settings: list[tuple[str, str]],
    prompt: str,
    max_tokens: int,
    top: int,
    **engine_args: Any,
) -> list[dict[str, Any]]:
    """One record per setting: its greedy text and the top log-probs of its first 3 steps.

    ``engine_args`` go to every ``LLM`` (a small pool for a test, say).
    """
    from kvserve import LLM, SamplingParams  # NOTE: torch; kept out of the CLI's import

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=top)
    out = []
    for quantization, dtype in settings:
        llm = LLM(model=model, quantization=quantization, dtype=dtype, **engine_args)
        answer = llm.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)
        completion = answer[0].outputs[0]
        tokenizer = llm.engine.tokenizer
        steps = [
            {tokenizer.decode([t]): round(lp.logprob, 3) for t, lp in step.items()}
            for step in (completion.logprobs or [])[:3]
        ]
        out.append(
            {
                "setting": f"{quantization}:{dtype}",
                "text": completion.text,
                "token_ids": list(completion.token_ids),
                "top_logprobs": steps,
            }
        )
        del llm
    return out


def main(argv: list[str] | None = None) -> int:
    """Print each setting's greedy answer and its first steps' top log-probs."""
    ap = argparse.ArgumentParser(
        prog="kvserve bench first-token", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--model", default=None, help="GGUF file or HF dir (default: embedded)")
    ap.add_argument("--prompt", default="What is the capital of France?")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--top", type=int, default=5, help="log-probs shown per step")
    ap.add_argument(
        "--settings",
        nargs="+",
        type=parse_setting,
        default=[parse_setting(s) for s in DEFAULT_SETTINGS],
        help="QUANTIZATION:DTYPE pairs (default: " + " ".join(DEFAULT_SETTINGS) + ")",
    )
    ap.add_argument("--json", action="store_true", help="one JSON document instead of text")
    args = ap.parse_args(argv)
    records = first_tokens(args.model, args.settings, args.prompt, args.max_tokens, args.top)
    if args.json:
        print(json.dumps(records, indent=1, ensure_ascii=False))
        return 0
    for rec in records:
        print(f"{rec['setting']}: {rec['text']!r}")
        for step in rec["top_logprobs"]:
            print(f"    {step}")
    return 0
