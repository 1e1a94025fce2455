"""Cross-origin requests (CORS) for the HTTP front doors: ``kvserve serve`` and the router."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware


def add_cors_arg(group: argparse._ActionsContainer) -> None:
    """``--allowed-origins``: the browser origins the server answers (CORS)."""
    group.add_argument(
        "--allowed-origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="let web pages on these origins call the API from a browser (CORS), e.g. "
        "http://localhost:3000, or * for any; none by default",
    )


def allow_cross_origin(app: FastAPI, origins: Sequence[str]) -> None:
    """Let browser pages on ``origins`` (``*``: any) call ``app`` (CORS); nothing if empty.

    NOTE: call it after every other middleware is added, so that it is the outermost layer:
    a preflight ``OPTIONS`` carries no API key and must be answered before the request guard
    would refuse it. vLLM allows every origin by default; here none unless asked
    (``--allowed-origins``), since any web page a user opens could otherwise drive a server
    on their loopback address.
    """
    if origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(origins), allow_methods=["*"], allow_headers=["*"]
        )
