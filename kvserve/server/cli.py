"""``kvserve serve``: the OpenAI-compatible server on the engine given by the engine flags."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from kvserve.server.tools import TOOL_CALL_PARSERS


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
    g.add_argument("--log-level", default="warning", help="uvicorn log level")
    p.set_defaults(func=cmd_serve)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: the text of a file, or the value itself when it is a Jinja
    template (as vLLM). Exits with a message when it is neither."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{%" in value or "{{" in value:
        return value
    raise SystemExit(f"kvserve serve: --chat-template: no such file: {value}")


def cmd_serve(args: argparse.Namespace) -> int:
    """Build the engine, then run uvicorn until interrupted."""
    import uvicorn

    from kvserve.async_engine import build_on_engine_thread
    from kvserve.engine import LLMEngine
    from kvserve.engine_config import EngineConfig
    from kvserve.server.app import build_app

    chat_template = load_chat_template(args.chat_template)
    config = EngineConfig.from_cli_args(args)
    engine, executor = build_on_engine_thread(lambda: LLMEngine(config))
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
        chat_template=chat_template,
        tool_call_parser=args.tool_call_parser,
    )
    print(
        f"[kvserve] serving {app.state.ctx.model_name!r} on http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
