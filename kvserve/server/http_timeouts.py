"""The HTTP server's timeouts: uvicorn's h11 protocol with a header-read deadline, and the
uvicorn config that sets it and the idle keep-alive timeout.

- header read: a connection must deliver a request's line and headers within the timeout
  from when it opens (or, kept alive, from the first byte of its next request); else it is
  closed. uvicorn has no such limit (a slow-loris client holds a connection for ever).
- keep-alive: uvicorn's ``timeout_keep_alive``, an idle connection between requests.
- body read: in the request guard (request_guard.py), which reads every POST body first.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvserve.server.limits import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_KEEP_ALIVE_TIMEOUT_S


def h11_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers are not all in
    ``header_timeout`` seconds after the request began (ValueError unless > 0)."""
    if not header_timeout > 0:
        raise ValueError(f"header_timeout must be > 0, got {header_timeout}")

    class HeaderDeadlineProtocol(H11Protocol):
        """H11Protocol with a deadline on the headers of each request."""

        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(cast(asyncio.Transport, transport))
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # NOTE: IDLE: the next request's headers are not all in yet (a kept-alive
            # connection's first bytes start its deadline); else they are: no deadline.
            if self.conn.their_state is h11.IDLE:
                if self._header_timer is None:
                    self._arm_header_timer()
            else:
                self._cancel_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.logger.warning(
                    "closing a connection whose request headers took over %.1f s", header_timeout
                )
                self.transport.close()

    return HeaderDeadlineProtocol


def uvicorn_config(
    app: Any,
    *,
    host: str,
    port: int,
    log_level: str = "warning",
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S,
) -> Any:
    """The uvicorn.Config serving ``app`` with these timeouts (seconds)."""
    import uvicorn

    if not keep_alive_timeout > 0:
        raise ValueError(f"keep_alive_timeout must be > 0, got {keep_alive_timeout}")
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, http=h11_protocol(header_timeout)
    )
    # NOTE: set after: uvicorn types it int, but hands it to loop.call_later (float seconds).
    config.timeout_keep_alive = keep_alive_timeout
    return config


def uvicorn_config_from_args(app: Any, args: Any, log_level: str | None = None) -> Any:
    """``uvicorn_config`` from ``serve``'s flags (``--host``, ``--port``,
    ``--uvicorn-log-level`` unless ``log_level`` is given, ``--timeout-header-read``,
    ``--timeout-keep-alive``); ``kvserve router`` has the same flags."""
    return uvicorn_config(
        app,
        host=args.host,
        port=args.port,
        log_level=log_level or args.uvicorn_log_level,
        header_timeout=args.timeout_header_read,
        keep_alive_timeout=args.timeout_keep_alive,
    )
