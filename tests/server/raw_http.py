"""Raw HTTP/1.1 over sockets, for tests of what a server does to slow or silent clients,
and a uvicorn server run in a thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

WAIT_S = 20.0  # how long a test waits for the server to act (a hang fails it)


@contextmanager
def running(server: Any) -> Iterator[None]:
    """Run ``server`` (a uvicorn.Server) in a thread until the block ends."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=WAIT_S)


def connect(port: int) -> socket.socket:
    """A client socket to the server on ``port`` (reads time out after WAIT_S)."""
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)


def read_until_closed(sock: socket.socket) -> bytes:
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


def read_response(sock: socket.socket) -> bytes:
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


def post_request(body: bytes) -> bytes:
    """The bytes of a JSON ``POST /v1/completions`` with ``body``."""
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
