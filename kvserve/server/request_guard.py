"""An ASGI layer in front of the app: auth, draining, body size and JSON hygiene.

Runs before any route reads the body, in this order:

1. API key (``Authorization: Bearer KEY``) on ``/v1/*``, ``/tokenize``, ``/detokenize`` and
   ``/debug/*`` (``/tokenize`` and ``/detokenize`` open with ``open_tokenize_endpoints``, as
   vLLM leaves them; ``/health`` and ``/metrics`` guarded with ``protect_metrics``): 401
   before a byte of the body is read.
2. Draining (SIGTERM received): 503 with ``Retry-After`` for every ``/v1/*`` request.
3. Body size and time: a ``Content-Length`` above ``max_request_bytes`` is a 413 at once; a
   body sent without one is read only until it passes the limit, then 413. A body not all in
   within ``body_timeout`` seconds is a 408 and the connection is closed.
4. JSON hygiene of every POST body (``/tokenize`` too): invalid UTF-8, nesting deeper than
   ``MAX_JSON_DEPTH``, numbers longer than ``MAX_NUMBER_DIGITS`` digits and lone UTF-16
   surrogates (``"\\ud800"``, valid JSON that no tokenizer can encode) are 400s naming the
   problem and the field; a body with a Content-Type other than JSON is a 415.

Everything else (malformed JSON, wrong types) is left to the app's own validation.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.errors import APIError
from kvserve.server.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES

MAX_JSON_DEPTH = 64
_THREAD_THRESHOLD_BYTES = 256 << 10
MAX_NUMBER_DIGITS = 1000


class RequestGuard:
    """Wraps an ASGI app (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None = None,
        protect_metrics: bool = False,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        is_draining: Callable[[], bool] = lambda: False,
        open_tokenize_endpoints: bool = False,
        body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    ) -> None:
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        if not body_timeout > 0:
            raise ValueError(f"body_timeout must be > 0, got {body_timeout}")
        self.app = app
        self.api_key = api_key
        self.protect_metrics = protect_metrics
        self.max_request_bytes = max_request_bytes
        self.is_draining = is_draining
        self.open_tokenize_endpoints = open_tokenize_endpoints
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        api = path.startswith("/v1/") or path == "/v1"
        if self.api_key is not None and self._needs_key(path, api):
            if not self._key_ok(scope):
                await _send_error(scope, receive, send, _unauthorized())
                return
        if api and self.is_draining():
            error = APIError(
                "the server is shutting down (draining); retry on another replica or later",
                status_code=503,
                code="draining",
                retry_after=5,
            )
            await _send_error(scope, receive, send, error)
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.body_timeout):
                body, error = await self._read_body(scope, receive)
        except TimeoutError:
            await _send_error(scope, receive, send, _body_too_slow(self.body_timeout), close=True)
            return
        if error is None and body:
            error = _check_content_type(_header(scope, b"content-type"))
        # NOTE: every POST route's body, not only /v1/*: /tokenize and /detokenize read JSON
        # too, and a lone surrogate or a deep nesting there raised past their handlers (500).
        if error is None:
            if len(body) > _THREAD_THRESHOLD_BYTES:
                # NOTE: a big body is checked on a worker thread, so the event loop (other
                # requests' streams) gets the GIL back every switch interval meanwhile.
                error = await asyncio.to_thread(check_json_body, body)
            else:
                error = check_json_body(body)
        if error is not None:
            await _send_error(scope, receive, send, error)
            return
        await self.app(scope, _replay(body, receive), send)

    def _needs_key(self, path: str, api: bool) -> bool:
        if api or path.startswith("/debug/"):
            return True
        if path in ("/tokenize", "/detokenize"):
            # NOTE: they run the tokenizer on any text sent: behind the key like /v1/*.
            return not self.open_tokenize_endpoints
        return self.protect_metrics and path in ("/health", "/metrics")

    def _key_ok(self, scope: Scope) -> bool:
        assert self.api_key is not None
        header = _header(scope, b"authorization")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        )

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[bytes, APIError | None]:
        limit = self.max_request_bytes
        length = _header(scope, b"content-length")
        if length.isdigit() and int(length) > limit:
            return b"", _too_large(int(length), limit)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # disconnected: the app sees an empty body and the disconnect
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return b"", _too_large(size, limit, at_least=True)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks), None


def _check_content_type(value: str) -> APIError | None:
    """A 415 for a body not sent as JSON (``curl -d`` sends a form type), as vLLM answers:
    the app would read it as something other than JSON and report a confusing type error."""
    media = value.partition(";")[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        return None
    got = f"Content-Type {media!r}" if media else "no Content-Type"
    return APIError(
        f"the request body must be JSON (Content-Type: application/json); got {got}",
        status_code=415,
        code="unsupported_media_type",
    )


def check_json_body(body: bytes) -> APIError | None:
    """A 400 naming the problem if ``body`` is JSON no handler should get, else None.

    Malformed JSON returns None: the app's own parser reports it (with its position).
    """
    if not body:
        return None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return APIError(
            f"the request body is not valid UTF-8 (byte {e.start}: {body[e.start : e.end]!r})",
            code="invalid_encoding",
        )
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float)
    except RecursionError:
        return APIError(
            f"the JSON body is nested too deeply (more than {MAX_JSON_DEPTH} levels)",
            code="json_too_deep",
        )
    except _NumberTooLong as e:
        return APIError(str(e), code="json_number_too_large")
    except ValueError:
        return None  # malformed: the app says where
    return _check_value(value)


class _NumberTooLong(ValueError):
    pass


def _parse_int(text: str) -> int:
    if len(text) > MAX_NUMBER_DIGITS:
        raise _NumberTooLong(
            f"a JSON number has {len(text)} digits; at most {MAX_NUMBER_DIGITS} are accepted"
        )
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > MAX_NUMBER_DIGITS:
        raise _NumberTooLong(
            f"a JSON number has {len(text)} characters; at most {MAX_NUMBER_DIGITS} are accepted"
        )
    return float(text)


def _check_value(value: Any) -> APIError | None:
    """Depth and lone surrogates, walked without recursion; names the field of a bad string."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            return APIError(
                f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels (at "
                f"{_dotted(path[:8])}...)",
                param=str(path[0]),
                code="json_too_deep",
            )
        if isinstance(item, str):
            bad = _surrogate_at(item)
            if bad is not None:
                return _surrogate_error(path, item, bad)
        elif isinstance(item, dict):
            for key, child in item.items():
                bad = _surrogate_at(key)
                if bad is not None:
                    return _surrogate_error((*path, "<key>"), key, bad)
                stack.append((child, (*path, key)))
        elif isinstance(item, list):
            stack.extend((child, (*path, i)) for i, child in enumerate(item))
    return None


def _surrogate_at(text: str) -> int | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _surrogate_error(path: tuple[str | int, ...], text: str, index: int) -> APIError:
    field = _dotted(path) or "body"
    return APIError(
        f"{field} contains text that cannot be encoded: a lone UTF-16 surrogate "
        f"(U+{ord(text[index]):04X}) at character {index}",
        param=str(path[0]) if path else None,
        code="invalid_encoding",
    )


def _dotted(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


def _unauthorized() -> APIError:
    return APIError(
        "missing or incorrect API key (send 'Authorization: Bearer <key>')",
        status_code=401,
        code="invalid_api_key",
    )


def _too_large(size: int, limit: int, *, at_least: bool = False) -> APIError:
    more = "more than " if at_least else ""
    return APIError(
        f"the request body has {more}{size} bytes; this server accepts at most {limit} "
        "(--max-request-bytes)",
        status_code=413,
        code="request_too_large",
    )


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields ``body`` once, then defers to the real one (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _body_too_slow(timeout: float) -> APIError:
    return APIError(
        f"the request body was not all received within {timeout:g} s (--timeout-body-read)",
        status_code=408,
        code="request_timeout",
    )


async def _send_error(
    scope: Scope, receive: Receive, send: Send, error: APIError, *, close: bool = False
) -> None:
    """Answer ``error``; ``close``: and close the connection after it (the rest of a body
    that was not read would otherwise be read as the next request)."""
    response = error.response()
    if close:
        response.headers["Connection"] = "close"
    await response(scope, receive, send)
