"""The greedy answer to one chat prompt and each step's top-5 log-probabilities, per setting.

    PYTHONPATH=. .venv/bin/python bench/probes/first_token.py [--prompt TEXT] [--max-tokens N]
        [--settings none:float32 auto:float32 auto:bfloat16]

A setting is ``quantization:dtype`` (``auto``: the GGUF's Q4_1 / Q8_0 weights on the int8-dot
kernels, whose int8 activations round; ``none``: the weights dequantized at load). Where the
settings' answers differ, the first step whose top tokens trade places says how near the tie
was.
"""

from __future__ import annotations

import argparse

from kvserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default="What is the capital of France?")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument(
        "--settings", nargs="+", default=["none:float32", "auto:float32", "auto:bfloat16"]
    )
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=5)
    for setting in args.settings:
        quantization, dtype = setting.split(":")
        llm = LLM(quantization=quantization, dtype=dtype)
        out = llm.chat([[{"role": "user", "content": args.prompt}]], params)[0].outputs[0]
        print(f"{setting}: {out.text!r}")
        tokenizer = llm.engine.tokenizer
        for step in out.logprobs[:3]:
            top = {tokenizer.decode([t]): round(lp.logprob, 3) for t, lp in step.items()}
            print(f"    {top}")
        del llm


if __name__ == "__main__":
    main()
