"""A tiny in-process OpenAI-style streaming server (FastAPI + uvicorn in a thread) for tests."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeState:
    """What the fake server saw, and how it answers."""

    first_delay_s: float = 0.0  # before the first chunk
    gap_s: float = 0.0  # between chunks
    send_usage: bool = True
    fail_every: int = 0  # answer 500 to every k-th request (0 = never)
    bodies: list[dict] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0


def build_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):  # noqa: ANN202
        body = await request.json()
        state.bodies.append(body)
        if state.fail_every and len(state.bodies) % state.fail_every == 0:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        num_tokens = int(body["max_tokens"])
        num_prompt = len(body["prompt"])

        async def stream() -> Iterator[str]:
            state.in_flight += 1
            state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
            try:
                await asyncio.sleep(state.first_delay_s)
                for i in range(num_tokens):
                    if i:
                        await asyncio.sleep(state.gap_s)
                    chunk = {"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                if state.send_usage:
                    usage = {"prompt_tokens": num_prompt, "completion_tokens": num_tokens}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@contextmanager
def serve_fake(state: FakeState) -> Iterator[str]:
    """Run the fake server on a free 127.0.0.1 port; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("fake server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
