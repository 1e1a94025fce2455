"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

``ENGINE_ERRORS`` is the one map from an engine exception to its HTTP status and error code;
``engine_error`` applies it. Every route, streaming or not, answers an engine failure through
it (an exception handler of the app, and the error event of an SSE stream), so the same
failure gets the same status everywhere:

- the engine cannot take the request now (queue full, loop dead, server draining): 503 with
  ``Retry-After``; another replica, or this one restarted, can serve it;
- the request's own input is wrong (the engine's validation raised ValueError): 400;
- the engine failed while running this request (it serves on): 500.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from kvserve.engine.async_engine import EngineDeadError, QueueFullError, RequestFailedError

_PARAM_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)")


class APIError(Exception):
    """An error the server answers with an OpenAI-style JSON body."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        """``retry_after``: seconds for a ``Retry-After`` header (503s get 1 by default)."""
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.type = type_ or _default_type(status_code)
        if retry_after is None and status_code == 503:
            retry_after = 1
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        """A JSONResponse carrying this error."""
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers)


def _default_type(status_code: int) -> str:
    if status_code == 401:
        return "authentication_error"
    if status_code == 404:
        return "not_found_error"
    if status_code == 413:
        return "request_too_large"
    if status_code < 500:
        return "invalid_request_error"
    return "server_error"


def from_value_error(e: BaseException, param: str | None = None) -> APIError:
    """A 400 for a ValueError raised by validation (SamplingParams, the engine); the
    parameter is taken from the message when it names one."""
    message = str(e)
    return APIError(message, status_code=400, param=param or _param_in(message))


def _param_in(message: str) -> str | None:
    """The request field a validation message names, if any."""
    m = _PARAM_IN_MESSAGE.search(message)
    if m:
        return m.group(1)
    if "max_tokens" in message:
        return "max_tokens"
    if "prompt" in message:
        return "prompt"
    return None


def from_validation_errors(errors: list[dict[str, Any]]) -> APIError:
    """A 400 for pydantic / FastAPI request-validation errors (malformed JSON, wrong types)."""
    if not errors:
        return APIError("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        detail = ctx.get("error", first.get("msg", ""))
        return APIError(f"malformed JSON body: {detail}", code="json_invalid")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    messages = []
    for err in errors[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        messages.append(f"{where}: {err.get('msg', 'invalid value')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return APIError("; ".join(messages) + more, param=param, code=first.get("type"))


@dataclass(frozen=True)
class ErrorStatus:
    """The HTTP status and OpenAI error code an engine exception is answered with."""

    status_code: int
    code: str | None


# NOTE: looked up along the exception's MRO, so a subclass gets its base's entry.
ENGINE_ERRORS: dict[type[BaseException], ErrorStatus] = {
    QueueFullError: ErrorStatus(503, "queue_full"),
    EngineDeadError: ErrorStatus(503, "engine_dead"),
    RequestFailedError: ErrorStatus(500, "request_failed"),
    ValueError: ErrorStatus(400, None),
}


def engine_error(e: BaseException) -> APIError:
    """The API error for an engine exception (``ENGINE_ERRORS``; anything else is a 500)."""
    if isinstance(e, APIError):
        return e
    for cls in type(e).__mro__:
        status = ENGINE_ERRORS.get(cls)
        if status is None:
            continue
        message = str(e)
        # NOTE: a client error names the field its message names (as from_value_error).
        param = _param_in(message) if status.status_code < 500 else None
        return APIError(message, status_code=status.status_code, code=status.code, param=param)
    return internal_error(e)


def internal_error(e: BaseException) -> APIError:
    """The 500 for a failure of the server itself; it names only the exception's type.

    NOTE: the exception's text stays in the log: it may quote internals or input."""
    return APIError(f"internal error ({type(e).__name__}); see the server log", status_code=500)
