"""``kvserve router``'s front door over real sockets: the header-read, body-read and
keep-alive timeouts and the body size limit hold there as they do on ``kvserve serve``,
before anything reaches a replica."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvserve.cli import build_parser
from kvserve.router.cli import router_server
from tests.router.fake_replica import fake_app, serve_in_thread
from tests.server.raw_http import connect, post_request, read_response, read_until_closed, running
from tests.server.server_proc import free_port

TIMEOUT_S = "0.5"  # every timeout of the router under test
BODY = b'{"prompt": "hi", "max_tokens": 2}'


@pytest.fixture(scope="module")
def router() -> Iterator[tuple[int, object]]:
    replica = fake_app("a")
    with serve_in_thread(replica) as url:
        port = free_port()
        args = build_parser().parse_args(
            ["router", "--replica", url, "--port", str(port), "--log-level", "error",
             "--timeout-header-read", TIMEOUT_S, "--timeout-body-read", TIMEOUT_S,
             "--timeout-keep-alive", TIMEOUT_S, "--max-request-bytes", "1000"]
        )  # fmt: skip
        with running(router_server(args)):
            yield port, replica


def test_a_silent_connection_is_closed(router: tuple[int, object]) -> None:
    port, _ = router
    with connect(port) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")  # never finished
        assert read_until_closed(sock) == b""


def test_a_slow_body_is_a_408_and_never_reaches_a_replica(router: tuple[int, object]) -> None:
    port, replica = router
    before = len(replica.state.requests)
    with connect(port) as sock:
        sock.sendall(post_request(BODY)[: -len(BODY) // 2])
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    assert len(replica.state.requests) == before


def test_a_body_over_the_limit_is_a_413(router: tuple[int, object]) -> None:
    port, replica = router
    before = len(replica.state.requests)
    with connect(port) as sock:
        sock.sendall(post_request(b'{"prompt": "' + b"x" * 2000 + b'"}'))
        reply = read_response(sock)
    assert reply.startswith(b"HTTP/1.1 413 "), reply
    assert len(replica.state.requests) == before


def test_requests_are_routed_and_an_idle_connection_is_closed(
    router: tuple[int, object],
) -> None:
    port, _ = router
    with connect(port) as sock:
        for _ in range(2):  # kept alive between requests
            sock.sendall(post_request(BODY))
            reply = read_response(sock)
            assert reply.startswith(b"HTTP/1.1 200 ") and b'"choices"' in reply, reply
        assert read_until_closed(sock) == b""  # then idle past the keep-alive timeout
