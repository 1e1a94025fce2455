"""Peak KV blocks held when identical requests arrive at once (embedded model, defaults).

    PYTHONPATH=. .venv/bin/python bench/probes/dedup_peak.py [--temperature T] [--copies N]

Each copy of the prompt is admitted while the first still prefills or decodes, so the copies
compute the same blocks in the same steps; the prefix cache swaps each later copy's block for
the cached twin once written (``dedup_blocks``). Run it from an older tree (PYTHONPATH) to see
the figure without that.
"""

from __future__ import annotations

import argparse

from kvserve import LLM, SamplingParams

PROMPT = "You are a helpful assistant. Answer briefly and precisely. " * 12 + "Tell me a story."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--copies", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    llm = LLM(max_num_batched_tokens=512, max_model_len=1024, num_kv_blocks=1024)
    engine, kv = llm.engine, llm.engine.kv_cache_manager
    peak = 0
    step = engine.step

    def counting_step():  # type: ignore[no-untyped-def]
        nonlocal peak
        out = step()
        peak = max(peak, kv.num_blocks - kv.num_free_blocks)
        return out

    engine.step = counting_step  # type: ignore[method-assign]
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True
    )
    outs = llm.generate([PROMPT] * args.copies, params, use_tqdm=False)
    stats = llm.stats()
    print(
        f"{args.copies} copies of a {len(outs[0].prompt_token_ids)}-token prompt, "
        f"{args.max_tokens} tokens each, temperature {args.temperature}: peak blocks held "
        f"{peak}, dedup_blocks {stats.get('dedup_blocks', 'n/a')}"
    )


if __name__ == "__main__":
    main()
