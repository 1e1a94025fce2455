"""The FastAPI app: the engine's state, the routers of routes.py, the request guard, and
OpenAI-style errors (engine exceptions through ``errors.ENGINE_ERRORS``)."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.cors import allow_cross_origin
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.engine_like import EngineLike
from kvserve.server.context import ServingContext
from kvserve.server.errors import (
    ENGINE_ERRORS,
    APIError,
    engine_error,
    from_validation_errors,
    internal_error,
)
from kvserve.server.lifecycle import DEFAULT_SHUTDOWN_TIMEOUT_S, Lifecycle
from kvserve.server.limits import DEFAULT_BODY_TIMEOUT_S
from kvserve.server.metrics import ServerMetrics
from kvserve.server.request_guard import DEFAULT_MAX_REQUEST_BYTES, RequestGuard
from kvserve.server.routes import api_router, debug_router, ops_router

logger = logging.getLogger("kvserve.server")


def build_app(
    engine: EngineLike,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queued_requests: int | None = None,
    debug_endpoints: bool = False,
    executor: ThreadPoolExecutor | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    protect_metrics: bool = False,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    chat_template: str | None = None,
    tool_call_parser: str = "hermes",
    allowed_origins: Sequence[str] = (),
    open_tokenize_endpoints: bool = False,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
) -> FastAPI:
    """An OpenAI-compatible app serving ``engine`` (an LLMEngine or the same interface).

    The step loop starts with the app (lifespan) or on the first request. The API key
    guards ``/v1/*``, ``/tokenize``, ``/detokenize`` (open with ``open_tokenize_endpoints``)
    and the debug routes (and ``/health`` and ``/metrics`` with ``protect_metrics``), checked
    before the body is read; see request_guard.py and
    lifecycle.py (``app.state.lifecycle``: draining on SIGTERM, exit code). Browsers on
    ``allowed_origins`` may call it (CORS; none by default).
    """
    metrics = ServerMetrics()
    async_engine = AsyncLLMEngine(
        engine, max_queued_requests=max_queued_requests, observer=metrics, executor=executor
    )
    lifecycle = Lifecycle(async_engine, shutdown_timeout=shutdown_timeout)
    async_engine.on_fatal = lifecycle.on_fatal
    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.state.engine = engine
    app.state.async_engine = async_engine
    app.state.ctx = ServingContext.for_engine(
        engine,
        async_engine,
        served_model_name=served_model_name,
        chat_template=chat_template,
        tool_call_parser=tool_call_parser,
    )
    app.state.metrics = metrics
    app.state.lifecycle = lifecycle
    app.include_router(ops_router)
    app.include_router(api_router)
    if debug_endpoints:
        app.include_router(debug_router)
    app.add_middleware(
        RequestGuard,
        api_key=api_key,
        protect_metrics=protect_metrics,
        max_request_bytes=max_request_bytes,
        is_draining=lambda: lifecycle.draining,
        open_tokenize_endpoints=open_tokenize_endpoints,
        body_timeout=body_timeout,
    )
    allow_cross_origin(app, allowed_origins)
    _install_error_handlers(app)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the step loop with the app; stop it (failing what is left) at shutdown.

    NOTE: the objects alive at start (model, tokenizer, libraries: ~380,000 tracked by the
    garbage collector) are frozen for the app's life: a full collection walks every tracked
    object, 140-150 ms on the AMX Xeon, a stall of every stream when it falls in the step
    loop. Frozen, they are skipped (a full collection then took 0.0 ms); what serving
    allocates is collected as before. Unfrozen at shutdown, so nothing stays uncollectable.
    """
    async_engine: AsyncLLMEngine = app.state.async_engine
    gc.collect()
    gc.freeze()
    async_engine.start()
    try:
        yield
    finally:
        await async_engine.shutdown()
        gc.unfreeze()


def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def validation_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return from_validation_errors(list(exc.errors())).response()

    async def http_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return APIError(str(exc.detail), status_code=exc.status_code).response()

    async def from_engine(_request: Request, exc: Exception) -> Response:
        return engine_error(exc).response()

    async def unhandled(_request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return internal_error(exc).response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    for cls in ENGINE_ERRORS:
        # NOTE: not ValueError: one escaping a route is a server bug (a 500); the engine's
        # own input checks become 400s where the engine is called (add_engine_requests).
        if cls is not ValueError:
            app.add_exception_handler(cls, from_engine)
    app.add_exception_handler(Exception, unhandled)
