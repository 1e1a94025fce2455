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


def fake_app(name: str, *, openai: bool = True, running: int = 0) -> FastAPI:
    """Completions answer ``"<name>:<i>"`` chunks; ``openai=False`` serves no model list."""
    app = FastAPI()
    app.state.requests = []

    @app.get("/v1/models")
    async def models() -> Response:
        if not openai:
            return PlainTextResponse("<html>hello</html>")
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

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
        body = await request.json()
        app.state.requests.append(body)
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
