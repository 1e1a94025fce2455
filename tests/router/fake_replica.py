"""A minimal OpenAI-style server in a thread: a stand-in replica for router tests."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tests.server.server_proc import free_port


def fake_app(
    name: str,
    *,
    openai: bool = True,
    running: int = 0,
    api_key: str | None = None,
    busy: bool = False,
) -> FastAPI:
    """Completions answer ``"<name>:<i>"`` chunks; ``openai=False`` serves no model list;
    ``api_key`` guards ``/v1/*``; ``busy`` answers every completion 503 ``queue_full``. A
    completion with ``"slow": true`` waits up to 10 s for its client to leave (counted in
    ``state.disconnected``); a body that is not JSON is a 400, as a kvserve replica answers."""
    app = FastAPI()
    app.state.requests = []
    app.state.disconnected = 0

    # NOTE: checked in the /v1 handlers, not by an HTTP middleware: Starlette's
    # BaseHTTPMiddleware hides a client's disconnect from the handler.
    def unauthorized(request: Request) -> Response | None:
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": {"code": "invalid_api_key"}}, status_code=401)
        return None

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if (refused := unauthorized(request)) is not None:
            return refused
        if not openai:
            return PlainTextResponse("<html>hello</html>")
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str) -> Response:
        return JSONResponse({"id": model_id, "object": "model", "by": name})

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": name})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await request.json()
        return JSONResponse({"tokens": [ord(c) for c in body["prompt"]], "by": name})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(
            "# HELP kvserve:num_requests_running r\n# TYPE kvserve:num_requests_running gauge\n"
            f"kvserve:num_requests_running {running}\n"
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        if (refused := unauthorized(request)) is not None:
            return refused
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError):
            return JSONResponse({"error": {"code": "json_invalid"}}, status_code=400)
        app.state.requests.append(body)
        if busy:
            error = {"error": {"code": "queue_full", "message": f"{name} is full"}}
            return JSONResponse(error, status_code=503, headers={"Retry-After": "7"})
        if body.get("slow"):
            for _ in range(200):
                if await request.is_disconnected():
                    app.state.disconnected += 1
                    return JSONResponse({}, status_code=499)
                await asyncio.sleep(0.05)
        n = int(body.get("max_tokens", 3))
        if not body.get("stream"):
            return JSONResponse({"choices": [{"index": 0, "text": f"{name}:" * n}]})

        async def events() -> AsyncIterator[str]:
            for i in range(n):
                await asyncio.sleep(0.01)
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": f"{name}:{i}"}]})
                yield "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextmanager
def serve_in_thread(app: FastAPI, port: int | None = None) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 in a daemon thread; yields its URL; stops it on exit."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake replica did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
