"""``kvserve bench accuracy``: what cache-size reductions cost in accuracy, next to what they save.

For each setting (KV cache dtype auto / int8 / fp8, windowed eviction W tokens + S sinks)
on the embedded model it measures:

- perplexity of a fixed English text (``bench/data/python_reference_excerpt.txt``), fed in
  chunks through the engine's own ModelRunner with teacher forcing: every chunk after the
  first reads the earlier chunks back from the (quantized / windowed) KV cache; on the same
  pass, the mean KL divergence from the first setting's distribution at every position and
  the fraction of positions with its top-1 token (as llama.cpp's ``--kl-divergence``);
- greedy agreement with the full-precision cache: per prompt, the fraction of generated
  tokens before the first divergence, and the fraction of positions that match overall;
- mid-context recall: a key-value fact placed in the middle of a long filler context and
  asked for at the end (accuracy over the cases);
- KV bytes per token (scales included), peak KV bytes one recall request holds, and
  generation throughput relative to the first setting.

NOTE: eviction is an accuracy change: windowed settings are expected to fail mid-context
recall once the fact leaves the window. The perplexity path masks out-of-window positions
exactly as the engine does (it does not free blocks, which changes no value).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvserve.core.outputs import ScheduledRequest, SchedulerOutput
from kvserve.engine.llm import LLM
from kvserve.runtime.model_runner import ModelRunner
from kvserve.sampling_params import SamplingParams

CORPUS = Path(__file__).resolve().parents[2] / "bench" / "data" / "python_reference_excerpt.txt"
DEFAULT_SETTINGS = "auto,int8,fp8,w64s4,w128s4"
_NAMES = [
    "red fox",
    "blue door",
    "old bridge",
    "green lamp",
    "silver key",
    "north tower",
    "small boat",
    "quiet garden",
    "iron gate",
    "paper kite",
]


@dataclass(frozen=True)
class Setting:
    """One cache configuration under test."""

    name: str
    kv_cache_dtype: str = "auto"
    kv_window: int | None = None
    kv_sink_tokens: int = 0
    quantization: str = "none"  # weights (EngineConfig.quantization)
    # NOTE: the model dtype is pinned (float32 unless the setting names bf16), so the
    # reference stays fp32 whatever the engine's ``dtype="auto"`` picks on this CPU.
    dtype: str = "float32"

    def engine_kwargs(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_window": self.kv_window,
            "kv_sink_tokens": self.kv_sink_tokens,
            "quantization": self.quantization,
        }


_MODEL_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def parse_setting(text: str) -> Setting:
    """``auto`` | ``int8`` | ``fp8`` | ``w<W>s<S>`` (window W, S sinks) | ``int8-w<W>s<S>``,
    or a model dtype ``fp32`` | ``bf16`` | ``fp16`` (weights, activations and cache);
    ``weights-<q>`` (``q`` a ``--quantization`` value: auto, q8_0, q4_0, q4_1) runs the
    weights quantized with a full-precision cache; ``<dtype>-weights-<q>`` (``bf16-weights-auto``)
    both, the model dtype for the activations and the cache."""
    head, sep, rest = text.partition("-weights-")
    if sep and head in _MODEL_DTYPES:
        return replace(parse_setting(f"weights-{rest}"), name=text, dtype=_MODEL_DTYPES[head])
    if text.startswith("weights-"):
        quantization = text.removeprefix("weights-")
        if quantization not in ("auto", "none", "q8_0", "q4_0", "q4_1"):
            raise ValueError(f"unknown weights setting {text!r}: e.g. weights-auto")
        return Setting(text, quantization=quantization)
    if text in _MODEL_DTYPES:
        return Setting(text, dtype=_MODEL_DTYPES[text])
    dtype, _, window = text.partition("-") if "-" in text else (text, "", "")
    if dtype.startswith("w"):
        dtype, window = "auto", dtype
    if dtype not in ("auto", "int8", "fp8"):
        raise ValueError(
            f"unknown setting {text!r}: use auto, int8, fp8, w64s4, int8-w64s4, fp32, bf16, fp16"
        )
    if not window:
        return Setting(text, dtype)
    body = window[1:]
    w, sep, s = body.partition("s")
    if not (w.isdigit() and sep and s.isdigit()):
        raise ValueError(f"unknown window setting {text!r}: expected w<W>s<S>, e.g. w64s4")
    return Setting(text, dtype, int(w), int(s))


@dataclass
class Result:
    """Figures of one setting."""

    setting: str
    kv_bytes_per_token: int
    perplexity: float
    kl_divergence: float | None  # mean KL(reference || setting) per position, nats
    top1_agreement: float | None  # fraction of positions with the reference's top-1 token
    agreement_prefix: float | None  # mean fraction of tokens before the first divergence
    agreement_overall: float | None  # fraction of positions with the same token
    recall: float
    peak_request_kv_bytes: int
    gen_tokens_per_s: float
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------- perplexity


@dataclass
class TeacherForced:
    """What one teacher-forced pass over the text gives: its perplexity, the log-probabilities
    of every position (kept for the reference setting only), and against a reference's: the
    mean KL divergence KL(reference || this) per position and the fraction of positions with
    the same top-1 token (llama.cpp's ``perplexity --kl-divergence`` "Mean KLD" and "Same
    top p")."""

    perplexity: float
    logprobs: list[torch.Tensor] | None = None  # one [n, vocab] float32 per chunk
    kl_divergence: float | None = None
    top1_agreement: float | None = None


@torch.inference_mode()
def perplexity(runner: ModelRunner, token_ids: list[int], chunk_size: int) -> float:
    """Teacher-forced perplexity of ``token_ids`` through ``runner``'s KV cache (see
    ``teacher_forced``)."""
    return teacher_forced(runner, token_ids, chunk_size).perplexity


@torch.inference_mode()
def teacher_forced(
    runner: ModelRunner,
    token_ids: list[int],
    chunk_size: int,
    reference: list[torch.Tensor] | None = None,
    keep_logprobs: bool = False,
) -> TeacherForced:
    """Teacher-forced pass of ``token_ids`` through ``runner``'s KV cache.

    The text runs as one sequence in chunks of ``chunk_size`` tokens (block ids 0, 1, ...);
    each chunk attends to the earlier ones through the cache. Uses the runner's cache dtype
    and window. Needs an idle engine (it writes blocks 0..n-1 directly). ``reference``: the
    log-probabilities a reference setting kept over the same text and chunks, for the KL
    divergence and top-1 agreement; ``keep_logprobs``: keep this pass's.
    """
    bs = runner.block_size
    num_tokens = len(token_ids)
    per_table = -(-num_tokens // bs)
    # NOTE: a hybrid KV cache (runner.kv_groups) reads one table per group over one pool, and
    # a block id belongs to one group: each group gets its own ids (windows are masked, not
    # freed, as with kv_window).
    num_tables = len(runner.kv_groups) if runner.kv_groups else 1
    if per_table * num_tables > runner.num_blocks:
        raise ValueError(
            f"{num_tokens} tokens need more than the pool's {runner.num_blocks} blocks"
        )
    tables = [list(range(g * per_table, (g + 1) * per_table)) for g in range(num_tables)]
    block_ids = tables[0]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    nll = kl = 0.0
    same_top1 = 0
    kept: list[torch.Tensor] = []
    for i, start in enumerate(range(0, num_tokens - 1, chunk_size)):
        end = min(start + chunk_size, num_tokens - 1)
        req = ScheduledRequest(
            request_id="ppl",
            token_ids=token_ids[start:end],
            start_pos=start,
            block_ids=block_ids,
            sample=False,
            sampling_params=params,
            prompt_token_ids=token_ids,
            output_token_ids=[],
            group_block_ids=tables if runner.kv_groups else None,
        )
        batch = runner.prepare_inputs(SchedulerOutput(scheduled=[req]))
        hidden = runner.model(
            batch.input_ids, batch.positions, runner.layer_caches, batch.attn_meta
        )  # [n, hidden]
        logits = runner.model.compute_logits(hidden).float()
        logprobs = torch.log_softmax(logits, dim=-1).cpu()  # [n, vocab]
        targets = torch.tensor(token_ids[start + 1 : end + 1])
        nll -= logprobs.gather(1, targets[:, None]).sum().item()
        if reference is not None:
            ref = reference[i]
            kl += (ref.exp() * (ref - logprobs)).sum().item()
            same_top1 += int((ref.argmax(-1) == logprobs.argmax(-1)).sum())
        if keep_logprobs:
            kept.append(logprobs)
    positions = num_tokens - 1
    return TeacherForced(
        perplexity=float(torch.tensor(nll / positions).exp()),
        logprobs=kept if keep_logprobs else None,
        kl_divergence=kl / positions if reference is not None else None,
        top1_agreement=same_top1 / positions if reference is not None else None,
    )


# ---------------------------------------------------------------------------- agreement


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(mean fraction before the first divergence, fraction of equal positions)."""
    prefix, equal, total = 0.0, 0, 0
    for a, b in zip(ref, got, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix += n / max(len(a), 1)
        equal += sum(x == y for x, y in zip(a, b, strict=False))
        total += max(len(a), len(b))
    return prefix / max(len(ref), 1), equal / max(total, 1)


# ---------------------------------------------------------------------------- recall


def recall_cases(
    llm: LLM, filler_ids: list[int], num_cases: int, filler_tokens: int, seed: int = 0
) -> list[tuple[list[int], str]]:
    """Prompts with one fact in the middle of ``filler_tokens`` of filler, and its answer."""
    tok = llm.tokenizer
    rng = random.Random(seed)
    cases = []
    for i in range(num_cases):
        name = _NAMES[i % len(_NAMES)]
        code = str(rng.randrange(1000, 10000))
        offset = rng.randrange(0, max(1, len(filler_ids) - filler_tokens))
        filler = filler_ids[offset : offset + filler_tokens]
        half = len(filler) // 2
        fact = tok.encode(f"\n\nThe secret code of the {name} is {code}.\n\n", False)
        question = tok.encode(
            f"\n\nQuestion: What is the secret code of the {name}?\n"
            f"Answer: The secret code of the {name} is",
            False,
        )
        cases.append((filler[:half] + fact + filler[half:] + question, code))
    return cases


def _request_blocks(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[int, int]:
    """KV blocks one request holds: (peak, after its last step before finishing).

    Runs it alone on an idle engine. NOTE: a windowed request frees blocks only after a
    step's allocation, so its peak includes a whole prefill chunk of the prompt.
    """
    engine = llm.engine
    kv = engine.kv_cache_manager
    engine.add_request(prompt, params, request_id="peak-probe")
    peak = last = 0
    while engine.has_unfinished_requests():
        held = round(kv.usage * kv.num_blocks)
        engine.step()
        peak = max(peak, held, round(kv.usage * kv.num_blocks))
        last = held
    return peak, last


# ---------------------------------------------------------------------------- driver


@dataclass
class Reference:
    """The first setting's greedy tokens and teacher-forced log-probabilities."""

    tokens: list[list[int]]
    logprobs: list[torch.Tensor]


def run_setting(
    setting: Setting,
    args: argparse.Namespace,
    text: str,
    reference: Reference | None,
) -> tuple[Result, Reference]:
    """All measurements of one setting on a fresh engine; with no ``reference``, this
    setting's greedy tokens and log-probabilities are returned as the reference."""
    llm = LLM(
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=2048,
        seed=0,
        **setting.engine_kwargs(),
    )
    engine = llm.engine
    corpus_ids = llm.tokenizer.encode(text, add_special_tokens=False)
    # 1) perplexity first, on the idle engine.
    forced = teacher_forced(
        engine.runner,
        corpus_ids[: args.ppl_tokens],
        args.chunk_size,
        reference=reference.logprobs if reference is not None else None,
        keep_logprobs=reference is None,
    )
    engine.kv_cache_manager.reset_prefix_cache()
    # 2) greedy agreement (+ throughput).
    rng = random.Random(1)
    prompts = []
    for _ in range(args.num_prompts):
        off = rng.randrange(0, len(corpus_ids) - args.prompt_tokens)
        prompts.append(corpus_ids[off : off + args.prompt_tokens])
    gen = SamplingParams(temperature=0.0, max_tokens=args.gen_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, gen, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    num_gen = sum(len(t) for t in tokens)
    prefix, overall = agreement(reference.tokens, tokens) if reference is not None else (None, None)
    # 3) mid-context recall.
    cases = recall_cases(llm, corpus_ids, args.num_recall, args.recall_filler)
    ask = SamplingParams(temperature=0.0, max_tokens=8)
    answers = llm.generate([c[0] for c in cases], ask, use_tqdm=False)
    hits = sum(code in a.outputs[0].text for (_, code), a in zip(cases, answers, strict=True))
    peak_blocks, last_blocks = _request_blocks(llm, cases[0][0], ask)
    stats = llm.stats()
    result = Result(
        setting=setting.name,
        kv_bytes_per_token=int(stats["kv_bytes_per_token"]),
        perplexity=forced.perplexity,
        kl_divergence=forced.kl_divergence,
        top1_agreement=forced.top1_agreement,
        agreement_prefix=prefix,
        agreement_overall=overall,
        recall=hits / max(len(cases), 1),
        peak_request_kv_bytes=peak_blocks * engine.config.block_size * engine.kv_bytes_per_token,
        gen_tokens_per_s=num_gen / elapsed,
        extra={
            "recall_prompt_tokens": len(cases[0][0]),
            "peak_request_blocks": peak_blocks,
            "decode_request_blocks": last_blocks,
            "window_freed_blocks": stats.get("window_freed_blocks", 0),
            "num_kv_blocks": stats["num_kv_blocks"],
        },
    )
    return result, reference or Reference(tokens, forced.logprobs or [])


def format_table(results: list[Result]) -> str:
    """Markdown table; throughput relative to the first row."""
    base = results[0]
    head = (
        "| setting | KV bytes/token | vs first | ppl | ppl vs first | KL vs first (nats) "
        "| top-1 agree | greedy agree (prefix) "
        "| greedy agree (overall) | mid-context recall | peak KV of one recall request "
        "| KV blocks held in decode | gen tok/s | vs first |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for r in results:
        agree_p = "ref" if r.agreement_prefix is None else f"{r.agreement_prefix:.3f}"
        agree_o = "ref" if r.agreement_overall is None else f"{r.agreement_overall:.3f}"
        kl = "ref" if r.kl_divergence is None else f"{r.kl_divergence:.5f}"
        top1 = "ref" if r.top1_agreement is None else f"{r.top1_agreement:.4f}"
        rows.append(
            f"| {r.setting} | {r.kv_bytes_per_token} | "
            f"{base.kv_bytes_per_token / r.kv_bytes_per_token:.2f}x smaller | "
            f"{r.perplexity:.3f} | {100 * (r.perplexity / base.perplexity - 1):+.2f}% | "
            f"{kl} | {top1} | {agree_p} | {agree_o} | {r.recall:.2f} | "
            f"{r.peak_request_kv_bytes / 2**20:.1f} MiB | {r.extra['decode_request_blocks']} | "
            f"{r.gen_tokens_per_s:.1f} | "
            f"{r.gen_tokens_per_s / base.gen_tokens_per_s:.2f}x |"
        )
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    """Options of ``kvserve bench accuracy``."""
    p = argparse.ArgumentParser(prog="kvserve bench accuracy", description=__doc__.split("\n")[0])
    p.add_argument(
        "--settings",
        default=DEFAULT_SETTINGS,
        help="comma list: auto, int8, fp8, w<W>s<S> (window), int8-w<W>s<S>, or a model "
        "dtype fp32, bf16, fp16; the first is the reference",
    )
    p.add_argument("--ppl-tokens", type=int, default=2048, help="tokens of text for perplexity")
    p.add_argument("--chunk-size", type=int, default=128, help="perplexity chunk (tokens)")
    p.add_argument("--num-prompts", type=int, default=32, help="greedy-agreement prompts")
    p.add_argument("--prompt-tokens", type=int, default=64, help="tokens per agreement prompt")
    p.add_argument("--gen-tokens", type=int, default=128, help="greedy tokens per prompt")
    p.add_argument("--num-recall", type=int, default=50, help="mid-context recall cases")
    p.add_argument("--recall-filler", type=int, default=600, help="filler tokens per case")
    p.add_argument("--num-kv-blocks", type=int, default=512, help="KV pool size per engine")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the accuracy benchmark; prints a markdown table. Returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = [parse_setting(s.strip()) for s in args.settings.split(",") if s.strip()]
    if not settings:
        raise ValueError("--settings is empty")
    text = CORPUS.read_text(encoding="utf-8")
    results: list[Result] = []
    reference: Reference | None = None
    for setting in settings:
        t0 = time.perf_counter()
        result, reference = run_setting(setting, args, text, reference)
        results.append(result)
        print(
            f"[{setting.name}] done in {time.perf_counter() - t0:.0f}s: {asdict(result)}",
            file=sys.stderr,
            flush=True,
        )
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "cpu_count": os.cpu_count(),
                    "results": [asdict(r) for r in results],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
