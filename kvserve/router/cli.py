"""``kvserve router --replica URL ...``: the prefix-aware router in front of kvserve servers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Callable
from typing import Any

from kvserve.cors import add_cors_arg
from kvserve.router.policy import ROUTING_POLICIES
from kvserve.server.http_flags import add_http_limit_args
from kvserve.server.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES


def add_router_args(p: argparse.ArgumentParser) -> None:
    """The routing flags (shared by ``router`` and ``serve --data-parallel-size``)."""
    g = p.add_argument_group("router")
    g.add_argument(
        "--routing",
        choices=ROUTING_POLICIES,
        default="prefix",
        help="prefix: longest routed prefix unless overloaded (default); round-robin; "
        "least-loaded (fewest running + waiting)",
    )
    g.add_argument(
        "--balance-margin",
        type=int,
        default=4,
        help="prefix routing takes the longest match while its load (running + waiting) is at "
        "most the least-loaded replica's + this margin (default 4)",
    )
    g.add_argument(
        "--max-tree-tokens",
        type=int,
        default=1 << 21,
        help="elements (token ids / prompt bytes) the prefix tree keeps before LRU trimming",
    )
    g.add_argument(
        "--min-match-ratio",
        type=float,
        default=0.5,
        help="a prefix match counts only if it covers this fraction of the request's prompt",
    )
    g.add_argument(
        "--probe-interval", type=float, default=1.0, help="seconds between replica probes"
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a replica may go without sending a byte of a request's answer before "
        "it leaves the pool and the request is retried elsewhere (default: no limit)",
    )


def register(
    sub: argparse._SubParsersAction,
    _engine_parser: Callable[..., argparse.ArgumentParser],
) -> None:
    """Add the ``router`` sub-command to the ``kvserve`` parser."""
    p = sub.add_parser(
        "router",
        help="route OpenAI requests over kvserve replicas (prefix-aware)",
        description="One OpenAI endpoint in front of independent kvserve (or OpenAI) servers.",
    )
    p.add_argument(
        "--replica", action="append", required=True, help="replica base URL (repeatable)"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="the key the replicas require, sent on the router's own calls to them (start-up "
        "check, probes, metrics); clients' Authorization headers are passed through as sent",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="warning", help="uvicorn log level")
    add_cors_arg(p)
    add_http_limit_args(p.add_argument_group("http limits"))
    add_router_args(p)
    p.set_defaults(func=cmd_router)


def build_validated_app(urls: list[str], args: argparse.Namespace):  # noqa: ANN201 - FastAPI
    """Validate the replicas (ValueError naming a bad URL), then build the router app."""
    import httpx

    from kvserve.router.app import build_router_app
    from kvserve.router.policy import make_policy
    from kvserve.router.replicas import ReplicaPool

    pool = ReplicaPool(
        urls, probe_interval_s=args.probe_interval, api_key=getattr(args, "api_key", None)
    )

    async def validate() -> None:
        async with httpx.AsyncClient() as client:
            await pool.validate_all(client)

    asyncio.run(validate())
    policy = make_policy(
        args.routing,
        balance_margin=args.balance_margin,
        max_tree_tokens=args.max_tree_tokens,
        min_match_ratio=getattr(args, "min_match_ratio", 0.5),
    )
    return build_router_app(
        pool,
        policy,
        request_timeout_s=getattr(args, "request_timeout", None),
        allowed_origins=getattr(args, "allowed_origins", ()),
        max_request_bytes=getattr(args, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES),
        body_timeout_s=getattr(args, "timeout_body_read", DEFAULT_BODY_TIMEOUT_S),
    )


def router_server(args: argparse.Namespace) -> Any:
    """The uvicorn.Server of ``kvserve router`` (replicas validated, app built), with the
    header-read and keep-alive timeouts of ``--timeout-header-read`` / ``--timeout-keep-alive``."""
    import uvicorn

    from kvserve.server.http_timeouts import uvicorn_config_from_args

    app = build_validated_app(args.replica, args)
    return uvicorn.Server(uvicorn_config_from_args(app, args, log_level=args.log_level))


def cmd_router(args: argparse.Namespace) -> int:
    """Validate the replicas, then serve the router until interrupted."""
    server = router_server(args)
    print(
        f"[kvserve] routing ({args.routing}) over {', '.join(args.replica)} "
        f"on http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run
        server.run()
    return 0 if server.started else 3  # uvicorn.run's exit code for a failed start
