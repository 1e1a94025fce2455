"""The HTTP front door's limit flags, shared by ``kvserve serve`` and ``kvserve router``:
request body size, and the header-read, body-read and keep-alive timeouts (see
http_timeouts.py and request_guard.py for what each one does)."""

from __future__ import annotations

import argparse

from kvserve.server.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BYTES,
)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_http_limit_args(g: argparse._ActionsContainer) -> None:
    """``--max-request-bytes``, ``--timeout-header-read``, ``--timeout-body-read`` and
    ``--timeout-keep-alive``."""
    g.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="answer 413 to a request body larger than this, before reading more "
        f"(default {DEFAULT_MAX_REQUEST_BYTES >> 20} MiB)",
    )
    g.add_argument(
        "--timeout-header-read",
        type=positive_float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help="close a connection whose request line and headers are not all in within this "
        f"(slow-loris clients; default {DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--timeout-body-read",
        type=positive_float,
        default=DEFAULT_BODY_TIMEOUT_S,
        metavar="SECONDS",
        help="answer 408 and close the connection when a request body is not all in within "
        f"this after its headers (default {DEFAULT_BODY_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=positive_float,
        default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
        metavar="SECONDS",
        help="close an idle kept-alive connection after this (uvicorn's timeout_keep_alive, "
        f"vLLM's flag; default {DEFAULT_KEEP_ALIVE_TIMEOUT_S:g})",
    )
