"""vLLM (CPU build) offline peer: ``LLM.generate`` on token-id prompts, EOS ignored.

Run with the vLLM venv's python (see install_vllm.sh / run_side_by_side.sh):

    OMP_NUM_THREADS=2 VLLM_ENABLE_V1_MULTIPROCESSING=0 $VLLM_VENV/bin/python \
        bench/peers/vllm_offline.py --model HF_DIR --workload W.jsonl --batch-sizes 1 8 32 \
        --dtype bfloat16 --out-dir bench/out/run

``--dtype`` (float32, bfloat16, float16; default float32) is vLLM's model dtype; the records
name the system ``vllm-fp32`` / ``vllm-bf16`` / ``vllm-fp16``, so both dtypes plot side by side.

The engine is built once; each batch size B runs the first B prompts together. With
``--num-prompts N`` (one batch size only: vLLM fixes ``max_num_seqs`` at start-up) it runs the
first N prompts at once with at most B in flight.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import peer_record  # noqa: E402

DTYPE_TAGS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="HF directory (vLLM cannot read GGUF)")
    ap.add_argument("--workload", required=True)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--num-prompts", type=int, default=None, help="run the first N prompts (default: B)"
    )
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPE_TAGS))
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args(argv)
    tag = DTYPE_TAGS[args.dtype]
    if args.num_prompts is not None and len(args.batch_sizes) != 1:
        ap.error("--num-prompts needs exactly one --batch-sizes value (max_num_seqs is fixed)")
    import vllm
    from vllm import LLM, SamplingParams

    prompts = peer_record.load_prompts(args.workload)
    t0 = time.perf_counter()
    # NOTE: "uni" keeps the model in this process on all OMP threads; the default
    # multi-process executor reserves a core and runs about half as fast on 2 cores.
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.batch_sizes),
        distributed_executor_backend="uni",
        seed=0,
    )
    print(f"vLLM {vllm.__version__} ready in {time.perf_counter() - t0:.0f} s", flush=True)
    # Warm-up on real prompts (first calls of new shapes are slower on the CPU backend).
    llm.generate(
        [{"prompt_token_ids": p} for p, _ in prompts[:2]],
        SamplingParams(max_tokens=4, temperature=0.0),
        use_tqdm=False,
    )
    for b in args.batch_sizes:
        n_req = args.num_prompts or b
        batch = prompts[:n_req]
        if len(batch) < n_req:
            raise ValueError(f"the trace has {len(prompts)} requests, fewer than {n_req}")
        params = [
            SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
            for _, n in batch
        ]
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], params, use_tqdm=False)
        dt = time.perf_counter() - t
        num_out = sum(len(o.outputs[0].token_ids) for o in outs)
        rec = peer_record.throughput_record(
            f"vllm-{tag}",
            vllm.__version__,
            b,
            sum(len(p) for p, _ in batch),
            num_out,
            dt,
            n_req,
            dtype=args.dtype,
        )
        peer_record.write(rec, args.out_dir, f"offline_vllm_{tag}_b{b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
