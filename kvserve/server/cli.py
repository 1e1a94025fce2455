"""``kvserve serve``: the OpenAI-compatible server on the engine given by the engine flags."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def register(
    sub: argparse._SubParsersAction,
    engine_parser: Callable[[argparse._SubParsersAction, str, str], argparse.ArgumentParser],
) -> None:
    """Add the ``serve`` sub-command to the ``kvserve`` parser."""
    p = engine_parser(sub, "serve", "serve the OpenAI-compatible API (completions, chat, models)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    g.add_argument(
        "--max-queued-requests",
        type=_positive_int,
        default=None,
        help="answer 503 at once when this many accepted requests have no output yet",
    )
    g.add_argument("--served-model-name", default=None, help="model id in the API")
    g.add_argument(
        "--debug-endpoints",
        action="store_true",
        help="enable GET /debug/integrity and /debug/stats (for tests)",
    )
    g.add_argument("--log-level", default="warning", help="uvicorn log level")
    g.add_argument(
        "--data-parallel-size",
        type=_positive_int,
        default=1,
        help="run N engine replicas behind the prefix-aware router (local processes, or Ray "
        "actors with --distributed-executor-backend ray)",
    )
    from kvserve.router.cli import add_router_args

    add_router_args(p)
    p.set_defaults(func=cmd_serve)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def cmd_serve(args: argparse.Namespace) -> int:
    """Build the engine, then run uvicorn until interrupted."""
    import uvicorn

    from kvserve.async_engine import build_on_engine_thread
    from kvserve.engine import LLMEngine
    from kvserve.engine_config import EngineConfig
    from kvserve.server.app import build_app

    if args.data_parallel_size > 1:
        from kvserve.router.data_parallel import serve_data_parallel

        return serve_data_parallel(args)
    config = EngineConfig.from_cli_args(args)
    engine, executor = build_on_engine_thread(lambda: LLMEngine(config))
    print(f"[kvserve] {engine.kernels.summary()}", file=sys.stderr)
    if not args.quiet:
        for line in engine.memory_report.lines():
            print(f"[kvserve] {line}", file=sys.stderr)
    app = build_app(
        engine,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        debug_endpoints=args.debug_endpoints,
        executor=executor,
    )
    print(
        f"[kvserve] serving {app.state.ctx.model_name!r} on http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
