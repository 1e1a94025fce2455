"""``kvserve bench router``: prefix-aware vs round-robin routing over local replicas, one run.

For each routing policy: start ``--num-replicas`` fresh ``kvserve serve`` processes (caches
empty), put the router in front (in this process), send the same multi-tenant trace (several
system prompts, many users each; every request is its tenant's system prompt + the user's own
question, tenant drawn at random), and read back the replicas' prefix-cache counters. Prints
one table (prefix hit rate, mean / p90 TTFT, throughput) and writes JSON with ``--json``.

Example: ``kvserve bench router --num-tenants 6 --users-per-tenant 12 --json out.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import sys
import threading
import time
from typing import Any

import httpx

from kvserve.bench.serve_client import ClientConfig, run_client
from kvserve.engine.config import EngineConfig
from kvserve.router.policy import ROUTING_POLICIES
from kvserve.sim.metrics import percentile
from kvserve.sim.workloads import FIRST_TOKEN_ID, WorkloadRequest


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags."""
    p = argparse.ArgumentParser(prog="kvserve bench router", description=__doc__)
    p.add_argument("--num-replicas", type=int, default=2)
    p.add_argument(
        "--routing", nargs="+", choices=ROUTING_POLICIES, default=["prefix", "round-robin"]
    )
    p.add_argument("--num-tenants", type=int, default=6, help="distinct system prompts")
    p.add_argument("--users-per-tenant", type=int, default=12, help="requests per tenant")
    p.add_argument("--system-prompt-len", type=int, default=384, help="tokens")
    p.add_argument("--question-len", type=int, default=24, help="tokens of each user's question")
    p.add_argument("--output-len", type=int, default=16, help="tokens generated per request")
    p.add_argument("--request-rate", type=float, default=4.0, help="requests/s (Poisson)")
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--num-kv-blocks", type=int, default=128, help="per replica")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--balance-margin", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--json", default=None, help="write the results here")
    return p


def tenant_trace(args: argparse.Namespace) -> list[WorkloadRequest]:
    """Each request: a random tenant's system prompt + a unique question (token ids)."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, args.vocab_size) for _ in range(n)]

    systems = [tokens(args.system_prompt_len) for _ in range(args.num_tenants)]
    n = args.num_tenants * args.users_per_tenant
    tenants = [i % args.num_tenants for i in range(n)]
    rng.shuffle(tenants)
    out = []
    for i, t in enumerate(tenants):
        ids = systems[t] + tokens(args.question_len)
        out.append(
            WorkloadRequest(f"req-{i}", len(ids), args.output_len, 0.0, ids, prefix_group=f"t{t}")
        )
    return out


def _counter(text: str, name: str) -> float:
    return sum(
        float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    )


def run_one(routing: str, args: argparse.Namespace, trace: list[WorkloadRequest]) -> dict[str, Any]:
    """Fresh replicas + the router with ``routing``; the trace through it; the figures."""
    import uvicorn

    from kvserve.router.cli import build_validated_app
    from kvserve.router.data_parallel import free_port, local_replicas

    config = EngineConfig(num_kv_blocks=args.num_kv_blocks, num_threads=args.num_threads)
    router_args = argparse.Namespace(
        routing=routing,
        balance_margin=args.balance_margin,
        max_tree_tokens=1 << 21,
        probe_interval=0.5,
        min_match_ratio=0.5,
    )
    with local_replicas(config, args.num_replicas, ["--quiet"]) as urls:
        app = build_validated_app(urls, router_args)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        try:
            cfg = ClientConfig(
                base_url=f"http://127.0.0.1:{port}",
                request_rate=args.request_rate,
                max_concurrency=args.max_concurrency,
                seed=args.seed,
            )
            records, duration = asyncio.run(run_client(cfg, trace))
            pages = [httpx.get(u + "/metrics").text for u in urls]
        finally:
            server.should_exit = True
            thread.join(timeout=10)
        routed = [app.state.pool.replicas[u].num_routed for u in urls]
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    hits = sum(_counter(t, "kvserve:prefix_cache_hits_total") for t in pages)
    queries = sum(_counter(t, "kvserve:prefix_cache_queries_total") for t in pages)
    out_tokens = sum(r.num_output_tokens for r in ok)
    return {
        "routing": routing,
        "num_requests": len(records),
        "num_failed": len(records) - len(ok),
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else math.nan,
        "ttft_p90_s": percentile(ttfts, 90),
        "duration_s": duration,
        "output_tokens_per_s": out_tokens / duration,
        "requests_per_s": len(ok) / duration,
        "routed_per_replica": routed,
    }


def main(argv: list[str] | None = None) -> int:
    """Run every routing policy in turn on the same trace; print the table."""
    args = build_parser().parse_args(argv)
    trace = tenant_trace(args)
    results = [run_one(r, args, trace) for r in args.routing]
    print(
        f"{len(trace)} requests: {args.num_tenants} tenants x {args.users_per_tenant} users, "
        f"system prompt {args.system_prompt_len} + question {args.question_len} tokens, "
        f"{args.output_len} out; {args.num_replicas} replicas x {args.num_kv_blocks} KV blocks, "
        f"{args.request_rate:g} req/s, <= {args.max_concurrency} in flight"
    )
    print("| routing | prefix hit rate | TTFT mean ms | TTFT p90 ms | out tok/s | req/s | routed |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['routing']} | {r['prefix_hit_rate']:.3f} | {r['ttft_mean_s'] * 1e3:.0f} | "
            f"{r['ttft_p90_s'] * 1e3:.0f} | {r['output_tokens_per_s']:.1f} | "
            f"{r['requests_per_s']:.2f} | {r['routed_per_replica']} |"
        )
    if any(r["num_failed"] for r in results):
        print("failed requests: " + ", ".join(f"{r['routing']} {r['num_failed']}" for r in results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
