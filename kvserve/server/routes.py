"""The HTTP routes, as module-level routers; ``build_app`` includes them.

Handlers are thin: they take the ServingContext (``ctx``, a dependency reading
``app.state.ctx``) and hand over to completions.py, chat.py and tokenization.py. An engine
exception a handler lets through is answered by the app's handlers from
``errors.ENGINE_ERRORS``.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

import kvserve
from kvserve.server import protocol as p
from kvserve.server.chat import create_chat_completion
from kvserve.server.completions import create_completion
from kvserve.server.context import Ctx, check_model, served_engine
from kvserve.server.errors import APIError
from kvserve.server.tokenization import detokenize, tokenize

# /health and /metrics: for load balancers and scrapers.
ops_router = APIRouter()
# The OpenAI API and vLLM's /tokenize and /detokenize.
api_router = APIRouter()
# Only with ``debug_endpoints``.
debug_router = APIRouter()


@ops_router.get("/health")
@ops_router.head("/health", include_in_schema=False)
async def health(request: Request, ctx: Ctx) -> Response:
    """200 while the engine runs and the server is not draining, else 503."""
    if ctx.engine.is_dead:
        return APIError(
            f"the engine loop has died: {ctx.engine.dead_error!r}",
            status_code=503,
            code="engine_dead",
        ).response()
    if request.app.state.lifecycle.draining:
        return APIError(
            "draining: the server is shutting down", status_code=503, code="draining"
        ).response()
    return JSONResponse({"status": "ok"})


@ops_router.get("/version")
async def version() -> Response:
    """The server's version, as vLLM's ``/version``."""
    return JSONResponse({"version": kvserve.__version__})


@ops_router.get("/metrics")
async def prometheus_metrics(request: Request, ctx: Ctx) -> Response:
    """Prometheus metrics: the server's latency histograms and the engine's counters."""
    metrics = request.app.state.metrics
    metrics.set_engine_stats(await ctx.engine.stats())
    return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@api_router.get("/v1/models")
async def list_models(ctx: Ctx) -> Response:
    """The one served model."""
    card = p.ModelCard(id=ctx.model_name, max_model_len=ctx.max_model_len)
    return JSONResponse(p.dump(p.ModelList(data=[card])))


@api_router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, ctx: Ctx) -> Response:
    """The served model's card; 404 for any other id."""
    check_model(ctx, model_id)
    return JSONResponse(p.dump(p.ModelCard(id=ctx.model_name, max_model_len=ctx.max_model_len)))


@api_router.post("/v1/completions")
async def completions(body: p.CompletionRequest, request: Request, ctx: Ctx) -> Response:
    """OpenAI completions (JSON, or SSE with ``stream``)."""
    return await create_completion(ctx, body, request)


@api_router.post("/v1/chat/completions")
async def chat_completions(body: p.ChatCompletionRequest, request: Request, ctx: Ctx) -> Response:
    """OpenAI chat completions (JSON, or SSE with ``stream``)."""
    return await create_chat_completion(ctx, body, request)


@api_router.post("/tokenize")
async def tokenize_route(request: Request, ctx: Ctx) -> Response:
    """vLLM's /tokenize: a prompt or chat messages -> token ids."""
    try:
        body = await request.json()
    except ValueError as e:
        raise APIError(f"malformed JSON body: {e}", code="json_invalid") from e
    return await tokenize(ctx, body)


@api_router.post("/detokenize")
async def detokenize_route(body: p.DetokenizeRequest, ctx: Ctx) -> Response:
    """vLLM's /detokenize: token ids -> text."""
    return await detokenize(ctx, body)


@debug_router.get("/debug/integrity")
async def integrity(request: Request, ctx: Ctx) -> Response:
    """The KV-cache manager's integrity check, run on the engine thread."""
    check = served_engine(request).kv_cache_manager.check_integrity
    try:
        await ctx.engine.run_in_engine(check)
    except AssertionError as e:  # NOTE: IntegrityError is one
        return JSONResponse({"ok": False, "error": str(e)}, status_code=500)
    return JSONResponse({"ok": True})


@debug_router.get("/debug/stats")
async def debug_stats(ctx: Ctx) -> Response:
    """The engine's stats as JSON."""
    return JSONResponse(_jsonable(await ctx.engine.stats()))


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
