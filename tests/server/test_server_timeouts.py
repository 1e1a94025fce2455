"""The server's timeouts over real sockets (uvicorn in a thread, the fake engine): headers
sent too slowly (slow loris), a body sent too slowly, an idle kept-alive connection."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from kvserve.server.app import build_app
from kvserve.server.http_timeouts import uvicorn_config
from tests.server.fake_engine import FakeEngine
from tests.server.raw_http import (
    WAIT_S,
    connect,
    post_request,
    read_response,
    read_until_closed,
    running,
)
from tests.server.server_proc import free_port

TIMEOUT_S = 0.5  # every timeout of the server under test
BODY = b'{"prompt": "hi", "max_tokens": 2}'


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    app = build_app(FakeEngine(max_model_len=64), body_timeout=TIMEOUT_S)
    port = free_port()
    config = uvicorn_config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="error",
        header_timeout=TIMEOUT_S,
        keep_alive_timeout=TIMEOUT_S,
    )
    with running(uvicorn.Server(config)):
        yield port


def test_headers_sent_too_slowly_are_cut_off(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")
        closed = threading.Event()

        def trickle() -> None:  # a header byte every 0.1 s, as a slow loris does
            try:
                for byte in b"X-Slow: " + b"a" * 400:
                    if closed.is_set():
                        return
                    sock.send(bytes([byte]))
                    time.sleep(0.1)
            except OSError:
                return

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        try:
            assert read_until_closed(sock) == b""  # closed, with nothing sent
        finally:
            closed.set()
        sender.join(WAIT_S)


def test_a_connection_that_sends_nothing_is_closed(port: int) -> None:
    with connect(port) as sock:
        assert read_until_closed(sock) == b""


def test_a_body_sent_too_slowly_is_a_408_and_the_connection_closes(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(post_request(BODY)[: -len(BODY) // 2])  # the headers and half the body
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    assert b"connection: close" in reply.lower() and b"request_timeout" in reply


def test_prompt_requests_are_served_and_an_idle_connection_is_closed(port: int) -> None:
    with connect(port) as sock:
        for _ in range(2):  # kept alive between prompt requests
            sock.sendall(post_request(BODY))
            reply = read_response(sock)
            assert reply.startswith(b"HTTP/1.1 200 ") and b'"choices"' in reply, reply
        assert read_until_closed(sock) == b""  # then idle past the keep-alive timeout
