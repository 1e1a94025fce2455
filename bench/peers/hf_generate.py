"""Baseline peer: HF transformers ``generate`` with static batches (greedy, EOS ignored).

    .venv/bin/python bench/peers/hf_generate.py --workload W.jsonl --batch-sizes 1 8 32 \
        --out-dir bench/out/run [--model HF_DIR_OR_GGUF] [--threads 2]

Each batch size B runs the first B prompts of the trace as one static batch (left-padded if
lengths differ) for max(output_len) new tokens; one record per B. With ``--num-prompts N`` it
runs the first N prompts in consecutive static batches of B. Only the tokens each request
asked for count as output: the ones a short request generates while it waits for the longest
of its batch are the waste of static batching.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import peer_record  # noqa: E402


def load(model: str | None):  # noqa: ANN201
    """(model, version): an exported HF directory, or a GGUF file (dequantised to fp32)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if model is None or model.endswith(".gguf"):
        if model is None:
            from kvserve.models.loader import default_model_path

            model = default_model_path()
        m = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model), gguf_file=os.path.basename(model), dtype=torch.float32
        )
    else:
        m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    return m.eval(), transformers.__version__


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--model", default=None, help="HF dir or GGUF (default: embedded GGUF)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--num-prompts", type=int, default=None, help="run the first N prompts (default: B)"
    )
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    model, version = load(args.model)
    prompts = peer_record.load_prompts(args.workload)
    pad = (
        model.config.eos_token_id
        if model.config.pad_token_id is None
        else model.config.pad_token_id
    )
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][0]]), max_new_tokens=4, do_sample=False)
        for b in args.batch_sizes:
            n_req = args.num_prompts or b
            if len(prompts) < n_req:
                raise ValueError(f"the trace has {len(prompts)} requests, fewer than {n_req}")
            dt = 0.0
            for i in range(0, n_req, b):
                batch = prompts[i : min(i + b, n_req)]
                width = max(len(p) for p, _ in batch)
                new = max(n for _, n in batch)
                ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
                t0 = time.perf_counter()
                model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=pad,
                )
                dt += time.perf_counter() - t0
            rec = peer_record.throughput_record(
                "transformers",
                version,
                b,
                sum(len(p) for p, _ in prompts[:n_req]),
                sum(n for _, n in prompts[:n_req]),
                dt,
                n_req,
                dtype="float32",
                batching="static",
            )
            peer_record.write(rec, args.out_dir, f"offline_transformers_b{b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
