"""What a long prompt in flight costs a new short request and a running stream.

One engine (embedded model, defaults otherwise), rounds alternating the prefill share:
a stream decodes; a LONG-token prompt arrives; one step later a 4-token request arrives.
Printed per round: the short request's TTFT (from its arrival), the long prompt's TTFT,
and the stream's largest and mean gap between tokens while the long prompt prefills; plus
the short request's TTFT with nothing else running (idle).

    kvserve bench long-prompt --rounds 2 --shares 0.5 1.0
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def ttft_idle(engine: LLMEngine, rng: random.Random) -> float:
    """A 4-token request's TTFT on an otherwise idle engine (seconds)."""
    t0 = time.perf_counter()
    rid = engine.add_request(_tokens(rng, 4), SamplingParams(max_tokens=1, temperature=0.0))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.outputs[0].token_ids:
                return time.perf_counter() - t0


def long_prompt_round(engine: LLMEngine, rng: random.Random, long_len: int) -> dict[str, float]:
    """One trial (module docstring); leaves the engine empty."""
    one = SamplingParams(max_tokens=1, temperature=0.0)
    stream = engine.add_request(
        _tokens(rng, 16), SamplingParams(max_tokens=6000, temperature=0.0, ignore_eos=True)
    )
    for _ in range(3):
        engine.step()
    t_long = time.perf_counter()
    long = engine.add_request(_tokens(rng, long_len), one)
    stream_times: list[float] = []
    got: dict[str, float] = {}
    t_short = 0.0
    while long not in got or "short" not in got:
        outs = engine.step()
        now = time.perf_counter()
        if not t_short:  # the short request arrives one step after the long one
            t_short = time.perf_counter()
            short = engine.add_request(_tokens(rng, 4), one)
        for out in outs:
            if out.request_id == stream and long not in got:
                stream_times.append(now)
            elif out.request_id == long and out.outputs[0].token_ids:
                got[long] = now - t_long
            elif t_short and out.request_id == short and out.outputs[0].token_ids:
                got["short"] = now - t_short
    engine.abort_request(stream)
    while engine.has_unfinished_requests():
        engine.step()
    gaps = [b - a for a, b in zip(stream_times, stream_times[1:], strict=False)] or [0.0]
    return {
        "short_ttft_s": got["short"],
        "long_ttft_s": got[long],
        "stream_max_gap_s": max(gaps),
        "stream_mean_gap_s": statistics.fmean(gaps),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the rounds and print one line per round and share."""
    ap = argparse.ArgumentParser(
        prog="kvserve bench long-prompt", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shares", type=float, nargs="+", default=[0.5, 1.0])
    ap.add_argument("--long-len", type=int, default=4000)
    args = ap.parse_args(argv)
    engine = LLMEngine()
    rng = random.Random(51)
    base = engine.scheduler.config
    ttft_idle(engine, rng)  # warm-up
    for r in range(args.rounds):
        for share in args.shares:
            engine.scheduler.config = dataclasses.replace(base, prefill_share=share)
            idle = ttft_idle(engine, rng)
            res = long_prompt_round(engine, rng, args.long_len)
            figures = " ".join(f"{k}={v:.3f}" for k, v in res.items())
            print(f"round={r} share={share} idle_ttft_s={idle:.3f} {figures}", flush=True)
    return 0
