"""The FastAPI app: thin routes over serving.py, OpenAI-style errors, auth, metrics."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.async_engine import AsyncLLMEngine, EngineLike
from kvserve.server import protocol as p
from kvserve.server.errors import APIError, from_validation_errors
from kvserve.server.lifecycle import DEFAULT_SHUTDOWN_TIMEOUT_S, Lifecycle
from kvserve.server.metrics import ServerMetrics
from kvserve.server.request_guard import DEFAULT_MAX_REQUEST_BYTES, RequestGuard
from kvserve.server.serving import (
    ServingContext,
    check_model,
    create_chat_completion,
    create_completion,
)
from kvserve.server.tokenization import detokenize, tokenize

logger = logging.getLogger("kvserve.server")


def default_model_name(engine: Any) -> str:
    """The model's file or directory name, without a .gguf suffix."""
    path = str(getattr(engine, "model_path", "") or "kvserve-model").rstrip("/")
    name = os.path.basename(path)
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


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
) -> FastAPI:
    """An OpenAI-compatible app serving ``engine`` (an LLMEngine or the same interface).

    The step loop starts with the app (lifespan) or on the first request. The API key
    guards ``/v1/*`` and the debug routes (and ``/health`` and ``/metrics`` with
    ``protect_metrics``), checked before the body is read; see request_guard.py and
    lifecycle.py (``app.state.lifecycle``: draining on SIGTERM, exit code).
    """
    metrics = ServerMetrics()
    async_engine = AsyncLLMEngine(
        engine, max_queued_requests=max_queued_requests, observer=metrics, executor=executor
    )
    lifecycle = Lifecycle(async_engine, shutdown_timeout=shutdown_timeout)
    async_engine.on_fatal = lifecycle.on_fatal
    max_model_len = int(engine.max_model_len)  # type: ignore[attr-defined]
    kv = getattr(engine, "kv_cache_manager", None)
    pool_tokens = kv.num_blocks * kv.block_size if kv is not None else max_model_len
    ctx = ServingContext(
        engine=async_engine,
        model_name=served_model_name or default_model_name(engine),
        max_model_len=max_model_len,
        vocab_size=int(engine.arch.vocab_size),  # type: ignore[attr-defined]
        tokenizer=engine.tokenizer,  # type: ignore[attr-defined]
        max_total_tokens=min(max_model_len, pool_tokens),
        chat_template=chat_template,
        tool_call_parser=tool_call_parser,
        validate_constraint=getattr(getattr(engine, "structured", None), "validate", None),
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        await async_engine.shutdown()

    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.state.ctx = ctx
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.lifecycle = lifecycle
    _install_error_handlers(app)
    app.add_middleware(
        RequestGuard,
        api_key=api_key,
        protect_metrics=protect_metrics,
        max_request_bytes=max_request_bytes,
        is_draining=lambda: lifecycle.draining,
    )

    @app.get("/health")
    @app.head("/health", include_in_schema=False)
    async def health() -> Response:
        if async_engine.is_dead:
            return APIError(
                f"the engine loop has died: {async_engine.dead_error!r}",
                status_code=503,
                code="engine_dead",
            ).response()
        if lifecycle.draining:
            return APIError(
                "draining: the server is shutting down", status_code=503, code="draining"
            ).response()
        return JSONResponse({"status": "ok"})

    api = APIRouter()

    @api.get("/v1/models")
    async def list_models() -> Response:
        card = p.ModelCard(id=ctx.model_name, max_model_len=ctx.max_model_len)
        return JSONResponse(p.dump(p.ModelList(data=[card])))

    @api.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> Response:
        check_model(ctx, model_id)
        return JSONResponse(p.dump(p.ModelCard(id=ctx.model_name, max_model_len=ctx.max_model_len)))

    @api.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request)

    @api.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)

    @api.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError as e:
            raise APIError(f"malformed JSON body: {e}", code="json_invalid") from e
        return await tokenize(ctx, body)

    @api.post("/detokenize")
    async def detokenize_route(body: p.DetokenizeRequest) -> Response:
        return await detokenize(ctx, body)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        metrics.set_engine_stats(await async_engine.stats())
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    if debug_endpoints:

        @api.get("/debug/integrity")
        async def integrity() -> Response:
            kv_manager = getattr(engine, "kv_cache_manager", None)
            if kv_manager is None:
                raise APIError("this engine has no kv_cache_manager", status_code=404)
            try:
                await async_engine.run_in_engine(kv_manager.check_integrity)
            except AssertionError as e:
                return JSONResponse({"ok": False, "error": str(e)}, status_code=500)
            return JSONResponse({"ok": True})

        @api.get("/debug/stats")
        async def debug_stats() -> Response:
            return JSONResponse(_jsonable(await async_engine.stats()))

    app.include_router(api)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> Response:
        return from_validation_errors(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        return APIError(str(exc.detail), status_code=exc.status_code).response()

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        # NOTE: the exception's text stays in the log: it may quote internals or input.
        return APIError(
            f"internal error ({type(exc).__name__}); see the server log", status_code=500
        ).response()


def _jsonable(value: Any) -> Any:
    """``value`` as strict JSON: non-finite floats (a figure not measured yet) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)
