"""``kvserve bench serve --base-url URL``: online latency and goodput of any OpenAI-API server.

The JSON record keeps the summaries and, under ``latency_samples``, the sorted per-request
TTFT / TPOT / e2e and the pooled ITLs (thinned to 1,000 points each) for ``bench plot``'s CDFs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from typing import Any

from kvserve.bench.report import make_record, print_figures, write_json
from kvserve.bench.serve_client import BACKENDS, ClientConfig, run_client
from kvserve.bench.serve_metrics import SLO, compute_metrics, latency_samples
from kvserve.bench.workload_args import add_workload_args, build_workload, workload_meta


def register(sub: argparse._SubParsersAction, engine_parser: Any) -> None:
    """Add ``bench serve`` (a client: no engine flags)."""
    del engine_parser
    p = sub.add_parser(
        "serve",
        help="online benchmark of an OpenAI-compatible server (kvserve, vLLM, llama-server)",
        description="Send a trace to a running OpenAI-compatible server (kvserve, vLLM, "
        "llama-server) and report TTFT, TPOT, ITL, end-to-end latency and goodput.",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument("--model", default=None, help="model id (default: first of /v1/models)")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="server kind: which non-OpenAI fields (ignore_eos, min_tokens) to send",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s of the arrival process (default inf: all at once)",
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the inter-arrival gaps (1 = Poisson, < 1 = bursty)",
    )
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="at most this many requests in flight"
    )
    p.add_argument("--slo-ttft", type=float, default=None, help="TTFT objective in milliseconds")
    p.add_argument("--slo-tpot", type=float, default=None, help="TPOT objective in milliseconds")
    p.add_argument(
        "--slo-itl",
        type=float,
        default=None,
        help="ITL objective in milliseconds, on each request's p99 inter-token gap",
    )
    p.add_argument(
        "--static-batch-size",
        type=int,
        default=None,
        help="static batching by the client: send up to N arrived requests at once, the next "
        "batch only when all of them are done (TTFT counts from arrival)",
    )
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--sampling-temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument(
        "--extra-body",
        default=None,
        help="JSON merged into every request, e.g. '{\"cache_prompt\": false}'",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument("--system", default=None, help="name of the system under test (for records)")
    p.add_argument("--system-version", default=None)
    p.add_argument("--label", default=None, help="free-form label stored in the JSON record")
    p.add_argument("--output-json", default=None, help="write the result record here")
    add_workload_args(p)
    p.set_defaults(func=cmd_serve)


def client_config(args: argparse.Namespace) -> ClientConfig:
    """The client settings from the flags; ValueError on bad ones."""
    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    return ClientConfig(
        base_url=args.base_url,
        model=args.model,
        backend=args.backend,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        static_batch_size=args.static_batch_size,
        ignore_eos=args.ignore_eos,
        temperature=args.sampling_temperature,
        seed=args.workload_seed,
        timeout_s=args.timeout,
        extra_body=extra,
        api_key=args.api_key,
    )


def slo_from_args(args: argparse.Namespace) -> SLO:
    """SLOs in seconds from the millisecond flags."""
    for name in ("slo_ttft", "slo_tpot", "slo_itl"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0 ms, got {value}")
    return SLO(
        ttft=args.slo_ttft / 1e3 if args.slo_ttft is not None else None,
        tpot=args.slo_tpot / 1e3 if args.slo_tpot is not None else None,
        itl=args.slo_itl / 1e3 if args.slo_itl is not None else None,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    """Send the trace, print the figures, save the record; exit 1 if every request failed."""
    cfg = client_config(args)
    slo = slo_from_args(args)
    requests = build_workload(args)
    records, duration = asyncio.run(run_client(cfg, requests))
    fig = compute_metrics(records, duration, slo)
    print_figures(fig, f"serve {args.base_url} ({len(requests)} requests)")
    write_json(
        args.output_json,
        make_record(
            "serve",
            fig,
            mode="server",
            system=args.system or args.backend,
            version=args.system_version or "unknown",
            label=args.label,
            base_url=args.base_url,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            static_batch_size=args.static_batch_size,
            workload=workload_meta(args),
            latency_samples=latency_samples(records),
        ),
    )
    return 0 if fig["completed"] else 1
