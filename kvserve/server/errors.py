"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

import re
from typing import Any

from fastapi.responses import JSONResponse

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


def from_value_error(e: ValueError, param: str | None = None) -> APIError:
    """A 400 for a ValueError raised by validation (SamplingParams, the engine)."""
    message = str(e)
    if param is None:
        m = _PARAM_IN_MESSAGE.search(message)
        if m:
            param = m.group(1)
        elif "max_tokens" in message:
            param = "max_tokens"
        elif "prompt" in message:
            param = "prompt"
    return APIError(message, status_code=400, param=param)


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
