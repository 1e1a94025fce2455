"""The server's timeouts over real sockets (uvicorn in a thread, the fake engine): headers
sent too slowly (slow loris), a body sent too slowly, an idle kept-alive connection."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from kvserve.server.app import build_app
from kvserve.server.http_timeouts import uvicorn_config
from tests.server.fake_engine import FakeEngine
from tests.server.server_proc import free_port

TIMEOUT_S = 0.5  # every timeout of the server under test
WAIT_S = 20.0  # how long a test waits for the server to act (a hang fails it)
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
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=WAIT_S)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout: it
    did not close it within WAIT_S)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def _read_response(sock: socket.socket) -> bytes:
    """One whole response (its head and its Content-Length bytes of body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.lower().split(b"\r\n")
        if line.startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, data
        body += chunk
    return head + b"\r\n\r\n" + body


def _request(body: bytes = BODY) -> bytes:
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def test_headers_sent_too_slowly_are_cut_off(port: int) -> None:
    with _connect(port) as sock:
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
            assert _read_until_closed(sock) == b""  # closed, with nothing sent
        finally:
            closed.set()
        sender.join(WAIT_S)


def test_a_connection_that_sends_nothing_is_closed(port: int) -> None:
    with _connect(port) as sock:
        assert _read_until_closed(sock) == b""


def test_a_body_sent_too_slowly_is_a_408_and_the_connection_closes(port: int) -> None:
    with _connect(port) as sock:
        sock.sendall(_request()[: -len(BODY) // 2])  # the headers and half the body
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    assert b"connection: close" in reply.lower() and b"request_timeout" in reply


def test_prompt_requests_are_served_and_an_idle_connection_is_closed(port: int) -> None:
    with _connect(port) as sock:
        for _ in range(2):  # kept alive between prompt requests
            sock.sendall(_request())
            reply = _read_response(sock)
            assert reply.startswith(b"HTTP/1.1 200 ") and b'"choices"' in reply, reply
        assert _read_until_closed(sock) == b""  # then idle past the keep-alive timeout
