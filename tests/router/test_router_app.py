"""The router app over stand-in replicas: start-up checks, 503, leaving and rejoining."""

from __future__ import annotations

import argparse
import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from kvserve.router.app import _event_has_token
from kvserve.router.cli import build_validated_app
from kvserve.router.keys import request_key
from kvserve.router.replicas import ReplicaError, parse_load
from tests.router.fake_replica import fake_app, serve_in_thread
from tests.server.server_proc import free_port, metric_value


def _args(routing: str = "prefix", probe: float = 0.1) -> argparse.Namespace:
    return argparse.Namespace(
        routing=routing,
        balance_margin=4,
        max_tree_tokens=1 << 16,
        probe_interval=probe,
        min_match_ratio=0.5,
    )


def test_non_openai_and_unreachable_replicas_are_rejected_at_start_up() -> None:
    with serve_in_thread(fake_app("x", openai=False)) as bad:
        with pytest.raises(ReplicaError, match=f"replica {bad} is not a kvserve/OpenAI server"):
            build_validated_app([bad], _args())
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ReplicaError, match=f"replica {dead} is not reachable"):
        build_validated_app([dead], _args())
    with pytest.raises(ValueError, match="at least one --replica"):
        build_validated_app([], _args())


def test_parse_load_sums_running_and_waiting() -> None:
    text = "kvserve:num_requests_running 2.0\nkvserve:num_requests_waiting 3.0\nother 9\n"
    assert parse_load(text) == 5
    assert parse_load('vllm:num_requests_running{model_name="m"} 4.0\n') == 4
    assert parse_load("nothing 1\n") is None


def _wait(cond, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def _text(client: TestClient) -> str:
    r = client.post("/v1/completions", json={"prompt": "p", "max_tokens": 1})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_leave_503_and_rejoin() -> None:
    port_b = free_port()
    a = serve_in_thread(fake_app("a"))
    url_a = a.__enter__()
    try:
        b = serve_in_thread(fake_app("b"), port=port_b)
        url_b = b.__enter__()
        app = build_validated_app([url_a, url_b], _args("round-robin"))
        pool = app.state.pool
        with TestClient(app) as client:
            assert {_text(client) for _ in range(4)} == {"a:", "b:"}
            assert client.get("/health").status_code == 200
            # b stops: requests sent to it fail to connect and are retried on a; b leaves
            b.__exit__(None, None, None)
            assert [_text(client) for _ in range(4)] == ["a:"] * 4
            _wait(lambda: not pool.replicas[url_b].healthy)
            assert client.get("/health").json()["healthy_replicas"] == [url_a]
            metrics = client.get("/metrics").text
            assert f'kvserve_router:replica_healthy{{replica="{url_b}"}} 0.0' in metrics
            # 8 requests received; every retry is one more attempt sent to a replica
            assert metric_value(metrics, "kvserve_router:client_requests_total") == 8
            retries = metric_value(metrics, "kvserve_router:retries_total")
            sent = [
                float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines()
                if line.startswith("kvserve_router:requests_total{")
            ]
            assert sum(sent) == 8 + retries
            assert f'kvserve:num_requests_running{{replica="{url_a}"}} 0.0' in metrics
            # b comes back on its port: the probes bring it back into the pool
            with serve_in_thread(fake_app("b"), port=port_b):
                _wait(lambda: pool.replicas[url_b].healthy)
                assert {_text(client) for _ in range(4)} == {"a:", "b:"}
            _wait(lambda: not pool.replicas[url_b].healthy)
            # both gone: 503 with a JSON error, and /health says so
            a.__exit__(None, None, None)
            _wait(lambda: not pool.replicas[url_a].healthy)
            r = client.post("/v1/completions", json={"prompt": "p", "max_tokens": 1})
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "no_replica"
            assert client.get("/health").status_code == 503
    finally:
        a.__exit__(None, None, None)


def test_streams_pass_through_and_prefix_routing_sticks() -> None:
    apps = {"a": fake_app("a"), "b": fake_app("b")}
    with serve_in_thread(apps["a"]) as url_a, serve_in_thread(apps["b"]) as url_b:
        app = build_validated_app([url_a, url_b], _args("prefix", probe=30.0))
        with TestClient(app) as client:
            with client.stream(
                "POST",
                "/v1/completions",
                json={"prompt": "S1 " * 20 + "hi", "max_tokens": 3, "stream": True},
            ) as r:
                lines = [x for x in r.iter_lines() if x]
            assert lines[-1] == "data: [DONE]" and len(lines) == 4
            first = lines[0].split('"text": "')[1][0]
            for i in range(6):
                body = {"prompt": "S1 " * 20 + f"user {i}", "max_tokens": 1}
                text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
                assert text == f"{first}:"
            # another system prompt goes to the other replica (no match: least-routed)
            text = client.post(
                "/v1/completions", json={"prompt": "Z2 " * 20, "max_tokens": 1}
            ).json()["choices"][0]["text"]
            assert text != f"{first}:"
            assert url_a in client.get("/metrics").text


def test_every_route_passes_through_and_errors_are_openai_style() -> None:
    with serve_in_thread(fake_app("a")) as url:
        app = build_validated_app([url], _args(probe=30.0))
        with TestClient(app) as client:
            assert client.head("/health").status_code == 200
            assert client.get("/version").json() == {"version": "a"}
            assert client.get("/v1/models/fake").json()["by"] == "a"
            tok = client.post("/tokenize", json={"prompt": "hi"}).json()
            assert tok == {"tokens": [104, 105], "by": "a"}
            missing = client.get("/v1/nothing")
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
            # bodies the router cannot key on still reach the replica, which answers them
            for body in ('{"prompt": [1, "a"]}', '{"prompt": [[1, null]]}',
                         '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}"):  # fmt: skip
                r = client.post(
                    "/v1/completions", content=body, headers={"content-type": "application/json"}
                )
                assert r.status_code in (200, 400), (r.status_code, r.text)


def test_request_key_stops_at_the_first_element_that_is_no_token_id() -> None:
    assert request_key({"prompt": [5, 6, "a", 7]}) == [5, 6]
    assert request_key({"prompt": [[1, None], [2]]}) == [1]
    assert request_key({"prompt": [True, 1]}) == []


def test_event_with_tool_calls_counts_as_a_token() -> None:
    call = {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_1"}]}}]}
    assert _event_has_token("data: " + json.dumps(call))
    role = {"choices": [{"delta": {"role": "assistant"}}]}
    assert not _event_has_token("data: " + json.dumps(role))


def test_replica_api_key_is_sent_on_the_routers_own_calls() -> None:
    with serve_in_thread(fake_app("a", api_key="k")) as url:
        with pytest.raises(ReplicaError, match="answered 401"):
            build_validated_app([url], _args())
        args = _args(probe=30.0)
        args.api_key = "k"
        app = build_validated_app([url], args)
        with TestClient(app) as client:
            body = {"prompt": "p", "max_tokens": 1}
            assert client.post("/v1/completions", json=body).status_code == 401
            ok = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer k"})
            assert ok.status_code == 200


def test_a_full_replica_passes_the_request_on() -> None:
    with serve_in_thread(fake_app("a", busy=True)) as url_a:
        with serve_in_thread(fake_app("b")) as url_b:
            app = build_validated_app([url_a, url_b], _args("round-robin", probe=30.0))
            with TestClient(app) as client:
                texts = {_text(client) for _ in range(4)}
                assert texts == {"b:"} and app.state.pool.replicas[url_a].healthy
        app = build_validated_app([url_a], _args(probe=30.0))
        with TestClient(app) as client:
            r = client.post("/v1/completions", json={"prompt": "p", "max_tokens": 1})
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
            assert r.headers["retry-after"] == "7"


def test_a_client_that_leaves_cuts_the_replicas_request() -> None:
    replica = fake_app("a")
    with serve_in_thread(replica) as url:
        with serve_in_thread(build_validated_app([url], _args(probe=30.0))) as router:
            body = {"prompt": "p", "max_tokens": 1, "slow": True}
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(router + "/v1/completions", json=body, timeout=0.5)
            _wait(lambda: replica.state.disconnected == 1)


def test_data_parallel_replicas_get_every_server_flag() -> None:
    from kvserve.cli import build_parser
    from kvserve.router.data_parallel import (
        replica_http_timeouts,
        replica_server_kwargs,
        server_flags,
    )

    parser = build_parser()
    given = ["serve", "--data-parallel-size", "2", "--api-key", "k", "--max-request-bytes",
             "2000", "--chat-template", "T{{ messages }}", "--protect-metrics",
             "--shutdown-timeout", "3.5", "--debug-endpoints", "--max-queued-requests", "4",
             "--served-model-name", "m", "--timeout-body-read", "7.5",
             "--timeout-header-read", "2.5", "--timeout-keep-alive", "1.5"]  # fmt: skip
    args = parser.parse_args(given)
    replica = parser.parse_args(["serve", *server_flags(args)])
    assert replica_server_kwargs(replica) == replica_server_kwargs(args)
    assert replica_server_kwargs(replica)["body_timeout"] == 7.5
    assert replica_http_timeouts(replica) == {"timeout_header_read": 2.5, "timeout_keep_alive": 1.5}
    assert replica.data_parallel_size == 1 and replica.quiet


def test_a_replica_silent_past_the_request_timeout_leaves_the_pool() -> None:
    with serve_in_thread(fake_app("a")) as url:
        args = _args(probe=30.0)
        args.request_timeout = 0.3
        app = build_validated_app([url], args)
        with TestClient(app) as client:
            body = {"prompt": "p", "max_tokens": 1, "slow": True}  # silent for up to 10 s
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"
            assert not app.state.pool.replicas[url].healthy
            assert "ReadTimeout" in app.state.pool.replicas[url].last_error
