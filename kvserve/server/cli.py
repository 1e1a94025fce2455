"""``kvserve serve``: the OpenAI-compatible server on the engine given by the engine flags."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from kvserve.cors import add_cors_arg
from kvserve.server.chat_template import load_chat_template
from kvserve.server.http_flags import add_http_limit_args, positive_int
from kvserve.server.limits import DEFAULT_SHUTDOWN_TIMEOUT_S
from kvserve.server.tools import TOOL_CALL_PARSERS


def register(
    sub: argparse._SubParsersAction,
    engine_parser: Callable[[argparse._SubParsersAction, str, str], argparse.ArgumentParser],
) -> None:
    """Add the ``serve`` sub-command to the ``kvserve`` parser."""
    p = engine_parser(sub, "serve", "serve the OpenAI-compatible API (completions, chat, models)")
    p.add_argument(
        "--config",
        metavar="FILE.yaml",
        default=None,
        help="read flags from a YAML file of flag names (dashes or underscores) to values, "
        "e.g. 'max_num_seqs: 8'; flags on the command line override it (vLLM's --config)",
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize",
    )
    g.add_argument(
        "--open-tokenize-endpoints",
        action="store_true",
        help="leave /tokenize and /detokenize open without the API key (as vLLM does)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=positive_int,
        default=None,
        help="answer 503 (with Retry-After) at once when this many requests wait for a seat",
    )
    g.add_argument("--served-model-name", default=None, help="model id in the API")
    g.add_argument(
        "--debug-endpoints",
        action="store_true",
        help="enable GET /debug/integrity and /debug/stats (for tests)",
    )
    add_http_limit_args(g)
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM, seconds in-flight requests may still run before they are ended "
        "with an error (a second signal ends them at once)",
    )
    g.add_argument(
        "--protect-metrics",
        action="store_true",
        help="the API key also guards /health and /metrics (open by default, as in vLLM)",
    )
    g.add_argument(
        "--debug-inject-faults",
        action="store_true",
        help="testing only: a prompt containing KVSERVE_INJECT_FAULT fails its steps, one "
        "containing KVSERVE_INJECT_FATAL stops the engine (see kvserve/engine/fault_injection.py)",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template file (or the template text) replacing the model's",
    )
    g.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=TOOL_CALL_PARSERS,
        help="how tool calls are read from the output (hermes: <tool_call>{...}</tool_call>)",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's log level (info: a line per request); kvserve's is --log-level",
    )
    add_cors_arg(g)
    g.add_argument(
        "--data-parallel-size",
        type=positive_int,
        default=1,
        help="run N engine replicas behind the prefix-aware router (local processes, or Ray "
        "actors with --distributed-executor-backend ray)",
    )
    from kvserve.router.cli import add_router_args

    add_router_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """Build the engine, then run uvicorn until interrupted."""
    from kvserve.engine.async_engine import build_on_engine_thread
    from kvserve.engine.config import EngineConfig
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.server.app import build_app
    from kvserve.server.http_timeouts import uvicorn_config_from_args

    if args.data_parallel_size > 1:
        from kvserve.router.data_parallel import serve_data_parallel

        return serve_data_parallel(args)
    chat_template = load_chat_template(args.chat_template)
    config = EngineConfig.from_cli_args(args)
    # NOTE: the engine logs its one start-up line (INFO) and the memory report (DEBUG).
    engine, executor = build_on_engine_thread(lambda: LLMEngine(config))
    if args.debug_inject_faults:
        from kvserve.engine.fault_injection import install

        install(engine)
        print("[kvserve] fault injection is ON (--debug-inject-faults)", file=sys.stderr)
    app = build_app(
        engine,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        debug_endpoints=args.debug_endpoints,
        executor=executor,
        max_request_bytes=args.max_request_bytes,
        protect_metrics=args.protect_metrics,
        shutdown_timeout=args.shutdown_timeout,
        chat_template=chat_template,
        tool_call_parser=args.tool_call_parser,
        allowed_origins=args.allowed_origins,
        open_tokenize_endpoints=args.open_tokenize_endpoints,
        body_timeout=args.timeout_body_read,
    )
    print(
        f"[kvserve] serving {app.state.ctx.model_name!r} on http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    lifecycle = app.state.lifecycle
    http_config = uvicorn_config_from_args(app, args)
    server = _draining_server(http_config, lifecycle)
    lifecycle.server = server
    lifecycle.exit_backstop = True
    server.run()
    # NOTE: every request has been answered and the engine stopped; skip the interpreter's
    # teardown of the model and KV pool (seconds on a loaded box), which would only stretch
    # the drain a supervisor waits for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(lifecycle.exit_code))


def _draining_server(config: Any, lifecycle: Any) -> Any:
    """A uvicorn.Server for ``config`` whose signals drain through ``lifecycle``."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn, except that SIGTERM / SIGINT drain with a deadline (Lifecycle) first.

        NOTE: the signal is not recorded in ``_captured_signals``: uvicorn re-raises those
        after its shutdown, which would end the process by the signal instead of exit 0.
        """

        def __init__(self, config: uvicorn.Config, lifecycle: Any) -> None:
            super().__init__(config)
            self.lifecycle = lifecycle
            self._loop: asyncio.AbstractEventLoop | None = None  # set once serving

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.should_exit:  # the drain is over: stop waiting for connections
                self.force_exit = True
                return
            loop = self._loop or asyncio.get_event_loop_policy().get_event_loop()
            # NOTE: the deadline counts from the signal's arrival, not from when the (busy)
            # loop gets to the callback.
            loop.call_soon_threadsafe(self.lifecycle.on_signal, time.monotonic())

        async def serve(self, sockets: Any = None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

    return DrainingServer(config, lifecycle)
