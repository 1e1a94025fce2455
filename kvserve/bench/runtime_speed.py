"""Decode speed of the bare runtime (ModelRunner, no scheduler): tokens/s at B=1 and B=32.

    .venv/bin/python -m kvserve.bench.runtime_speed [--batch-sizes 1 32] [--steps 64]
        [--prompt-len 128] [--threads 2] [--repeats 1] [--model PATH] [--profile]
        [--floor] [--dtype {auto,float32,bfloat16,float16}]
        [--kernel-selection {auto,measure,off}] [--json PATH]

Each batch size: B distinct random prompts of ``prompt_len`` tokens are prefilled (in chunks of
at most ``--max-batched-tokens``), then ``steps`` greedy decode steps run for all B sequences
at once. Reported: prefill tokens/s and decode tokens/s (B x steps / decode wall time).
With ``--repeats R`` the decode phase runs R times from the same prefilled state (rewriting
the same cache slots) and the best and median of the R runs are reported: on a shared
machine the best run is the least disturbed one.

Bounds printed next to the figures:

- the memory-bandwidth bound: weight bytes one decode step reads (``decode_weight_bytes``)
  over the machine's read bandwidth (``read_bandwidth``: ``torch.sum`` over 1 GiB, best of 5),
  i.e. the tokens/s of one stream if a step did nothing but stream its weights once;
- with ``--floor``: the weight matmuls alone (``matmul_floor_step``: the step's GEMMs with
  the same shapes, nothing else), run right after each decode run so that both see the same
  machine. On a shared machine whose speed drifts, ``decode_vs_floor`` (decode step time /
  matmul time, medians) is the figure that stays put: it is the engine's own overhead.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kvserve.core.outputs import ScheduledRequest, SchedulerOutput
from kvserve.engine.config import DTYPE_CHOICES, KERNEL_SELECTION_MODES
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import load_model
from kvserve.models.quant import QUANTIZATION_CHOICES
from kvserve.models.quant_model import decode_weight_bytes, quantized_decode_bytes
from kvserve.models.quant_select import quantized_projections
from kvserve.runtime.autotune import TuneSettings, choose_kernels
from kvserve.runtime.linear import gather_into_huge_pages
from kvserve.runtime.model_runner import ModelRunner
from kvserve.runtime.native.chunk_limit import configure_backend
from kvserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def _req(rid: str, tokens: list[int], start: int, end: int, blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=rid,
        token_ids=tokens[start:end],
        start_pos=start,
        block_ids=blocks,
        sample=end == len(tokens),
        sampling_params=GREEDY,
        prompt_token_ids=tokens,
        output_token_ids=[],
    )


def read_bandwidth(
    nbytes: int = 1 << 30, repeats: int = 5, device: str | torch.device = "cpu"
) -> float:
    """Memory read bandwidth in bytes/s: the best of ``repeats`` ``torch.sum`` over ``nbytes``.

    NOTE: a sum reads every byte once and writes nothing, like a decode step's weight
    stream; it runs on the current torch thread count.
    """
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms the pages up
        _sync(x.device)
        t = time.perf_counter()
        x.sum()
        _sync(x.device)
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def matmul_floor_step(model: LlamaForCausalLM, batch_size: int, steps: int) -> float:
    """Seconds per step of only the weight matmuls of a ``batch_size``-row decode step.

    The same GEMM shapes, weights and kernels (each projection's ``Linear``, as the forward
    runs it) as the model's linear layers and lm_head, fed with random activations,
    ``steps`` times; no attention, norms or sampling.
    """
    ref = model.norm
    arch = model.arch
    q_size = arch.num_attention_heads * arch.head_dim
    x = torch.randn(batch_size, arch.hidden_size, dtype=ref.dtype, device=ref.device)
    attn = torch.randn(batch_size, q_size, dtype=ref.dtype, device=ref.device)
    act = torch.randn(batch_size, arch.intermediate_size, dtype=ref.dtype, device=ref.device)
    model.ensure_linears()  # the forward's own methods, built (prepacked) before the clock
    _sync(ref.device)
    t = time.perf_counter()
    for _ in range(steps):
        for layer in model.layers:
            layer.qkv_proj(x)
            layer.o_proj(attn)
            layer.gate_up_proj(x)
            layer.down_proj(act)
        model.lm_head_proj(x)
    _sync(ref.device)
    return (time.perf_counter() - t) / steps


def run_batch(
    runner: ModelRunner,
    batch_size: int,
    prompt_len: int,
    steps: int,
    max_batched_tokens: int,
    seed: int = 0,
    repeats: int = 1,
    profile: bool = False,
    floor: bool = False,
) -> dict[str, float | str]:
    """Prefill ``batch_size`` random prompts, then decode ``steps`` tokens for all of them.

    The decode phase runs ``repeats`` times from the same prefilled state; the figures are
    those of the fastest run, plus ``decode_tok_s_median`` over all runs. With ``profile``
    one more decode run goes under ``torch.profiler`` and ``profile`` holds its op table.
    With ``floor`` (needs a ``LlamaForCausalLM``) each decode run is followed by
    ``matmul_floor_step`` over as many steps: ``floor_tok_s`` (best), ``floor_tok_s_median``
    and ``decode_vs_floor`` (median decode step / median matmul step).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    rng = random.Random(seed)
    bs = runner.block_size
    blocks_per_seq = -(-(prompt_len + steps) // bs)
    if batch_size * blocks_per_seq > runner.num_blocks:
        raise ValueError(f"{batch_size} sequences need more than {runner.num_blocks} blocks")
    free = list(range(runner.num_blocks))
    rng.shuffle(free)
    vocab = runner.arch.vocab_size
    seqs = {f"r{i}": [rng.randrange(vocab) for _ in range(prompt_len)] for i in range(batch_size)}
    tables = {rid: [free.pop() for _ in range(blocks_per_seq)] for rid in seqs}
    # Prefill, packing prompt chunks under the token budget.
    t0 = time.perf_counter()
    pos = dict.fromkeys(seqs, 0)
    while any(p < prompt_len for p in pos.values()):
        budget = max_batched_tokens
        sched = []
        for rid, tokens in seqs.items():
            if pos[rid] < prompt_len and budget > 0:
                end = min(prompt_len, pos[rid] + budget)
                sched.append(_req(rid, tokens, pos[rid], end, tables[rid]))
                budget -= end - pos[rid]
                pos[rid] = end
        out = runner.execute(SchedulerOutput(scheduled=sched))
        for rid, tok in out.sampled_token_ids.items():
            seqs[rid].append(tok)
    t_prefill = time.perf_counter() - t0
    runs = []
    floors = []
    for _ in range(repeats):
        runs.append(_decode(runner, seqs, tables, steps))
        if floor:
            floors.append(matmul_floor_step(runner.model, batch_size, steps - 1))
    t_decode, cpu_decode = min(runs)
    table = ""
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            _decode(runner, seqs, tables, steps)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    extra: dict[str, float] = {}
    if floors:
        median_step = statistics.median(t for t, _ in runs) / (steps - 1)
        extra = {
            "floor_tok_s": batch_size / min(floors),
            "floor_tok_s_median": batch_size / statistics.median(floors),
            "decode_vs_floor": median_step / statistics.median(floors),
        }
    return {
        **extra,
        "profile": table,
        "batch_size": batch_size,
        "prefill_tok_s": batch_size * prompt_len / t_prefill,
        "decode_tok_s": batch_size * (steps - 1) / t_decode,
        "decode_tok_s_median": batch_size * (steps - 1) / statistics.median(t for t, _ in runs),
        "decode_step_ms": 1000 * t_decode / (steps - 1),
        # NOTE: process CPU time per step; with 1 thread it is a load-robust proxy for wall time
        # on a shared machine (with more threads it includes OpenMP spin-waiting).
        "decode_cpu_ms": 1000 * cpu_decode / (steps - 1),
    }


def _decode(
    runner: ModelRunner, prefilled: dict[str, list[int]], tables: dict[str, list[int]], steps: int
) -> tuple[float, float]:
    """``steps - 1`` greedy decode steps from ``prefilled`` (left as is); (wall s, CPU s)."""
    seqs = {rid: list(tokens) for rid, tokens in prefilled.items()}
    t1 = time.perf_counter()
    c1 = time.process_time()
    for _ in range(steps - 1):
        sched = [_req(rid, t, len(t) - 1, len(t), tables[rid]) for rid, t in seqs.items()]
        out = runner.execute(SchedulerOutput(scheduled=sched))
        for rid, tok in out.sampled_token_ids.items():
            seqs[rid].append(tok)
    return time.perf_counter() - t1, time.process_time() - c1


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point; prints one line per batch size."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF dir (default: embedded)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="decode runs per batch size")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attn-backend", default="auto")
    ap.add_argument(
        "--profile", action="store_true", help="print a torch.profiler table of one decode run"
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="after each decode run, time the same weight matmuls alone (see module doc)",
    )
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="as the engine's")
    ap.add_argument(
        "--kernel-selection",
        default="auto",
        choices=KERNEL_SELECTION_MODES,
        help="as the engine's (off: torch.mm everywhere, the original fp32 MKL path)",
    )
    ap.add_argument("--json", default=None, help="write the figures to this JSON file")
    ap.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATION_CHOICES,
        help="weights as the engine's --quantization (auto: a GGUF runs as stored)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth(device=args.device)
    t0 = time.perf_counter()
    loaded = load_model(args.model, torch.float32, args.quantization)
    model = LlamaForCausalLM(loaded.arch, device=args.device, attn_backend=args.attn_backend)
    model.load_weights(loaded.state_dict)
    del loaded
    kernels = choose_kernels(
        TuneSettings(args.dtype, args.device, args.kernel_selection),
        model.arch,
        quantized_projections(model),
    )
    print(kernels.summary())
    blocks_per_seq = -(-(args.prompt_len + args.steps) // args.block_size)
    runner = ModelRunner(
        model,
        model.arch,
        num_blocks=max(args.batch_sizes) * blocks_per_seq,
        block_size=args.block_size,
        device=args.device,
        dtype=kernels.dtype,
    )
    model.set_linear_plan(kernels.plan)  # the quantized projections' included
    model.ensure_linears()
    configure_backend(
        model.attn_backend,
        model.arch,
        kernels.dtype,
        args.max_batched_tokens,
        mode=args.kernel_selection,
        device=args.device,
    )
    model.release_packed_weights()  # as the engine does
    if torch.device(args.device).type == "cpu":
        gather_into_huge_pages(model.linears())
    weight_bytes = decode_weight_bytes(model) + quantized_decode_bytes(model)
    bound = bandwidth / weight_bytes
    print(f"loaded in {time.perf_counter() - t0:.1f}s; threads={torch.get_num_threads()}")
    print(
        f"weights read per decode step {weight_bytes / 1e6:.1f} MB; read bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s (torch.sum over 1 GiB, best of 5) -> bandwidth bound "
        f"{bound:.1f} steps/s (tok/s per stream)"
    )
    record: dict[str, object] = {
        "benchmark": "runtime_speed",
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "dtype_chosen": kernels.dtype_name,
        "kernels": kernels.summary(),
        "weight_bytes_per_step": weight_bytes,
        "read_bandwidth_bytes_per_s": bandwidth,
        "bandwidth_bound_steps_per_s": bound,
        "results": [],
    }
    run_batch(runner, 1, 16, 4, args.max_batched_tokens)  # warm-up
    for b in args.batch_sizes:
        r = run_batch(
            runner,
            b,
            args.prompt_len,
            args.steps,
            args.max_batched_tokens,
            repeats=args.repeats,
            profile=args.profile,
            floor=args.floor,
        )
        if r["profile"]:
            print(r["profile"])
        record["results"].append({k: v for k, v in r.items() if k != "profile"})
        median = (
            f", median of {args.repeats} {r['decode_tok_s_median']:.1f}" if args.repeats > 1 else ""
        )
        share = 100 * r["decode_tok_s"] / (b * bound)
        print(
            f"B={b:3d}  prefill {r['prefill_tok_s']:7.1f} tok/s  decode {r['decode_tok_s']:7.1f} "
            f"tok/s  ({r['decode_step_ms']:.1f} ms/step, {r['decode_cpu_ms']:.1f} cpu-ms/step"
            f"{median}); steps/s = {share:.0f} % of the bandwidth bound"
        )
        if args.floor:
            print(
                f"       weight matmuls alone {r['floor_tok_s']:7.1f} tok/s (median "
                f"{r['floor_tok_s_median']:.1f}); decode step = {r['decode_vs_floor']:.2f} x "
                "the matmul time (medians)"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
