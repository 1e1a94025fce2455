"""A real ``kvserve serve`` process on a tiny model: SIGTERM drains with a deadline and exits
0, an injected request fault fails only that request, an unattributable fault exits 1."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from kvserve.engine.fault_injection import (
    FATAL_FAULT_MARKER,
    REQUEST_FAULT_MARKER,
    SLOW_STEP_MARKER,
)
from tests.server.server_proc import server_process
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def _long_stream_body(max_tokens: int = 900) -> dict:
    # NOTE: the slow marker (with --debug-inject-faults) makes each of its steps take 20 ms,
    # so the stream outlasts the drain deadline however fast the machine decodes.
    return {"prompt": f"once upon a time {SLOW_STEP_MARKER}", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip


def test_sigterm_drains_with_a_deadline_and_exits_zero(model_dir: Path) -> None:
    args = ("--model", str(model_dir), "--shutdown-timeout", "1.5", "--debug-inject-faults")
    with server_process(*args) as (url, proc), httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=_long_stream_body()) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            health = c.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "draining"
            new = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert new.status_code == 503 and new.headers["retry-after"]
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "shut down" in json.loads(events[-2])["error"]["message"]
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 15


def test_injected_fault_fails_only_its_request(model_dir: Path) -> None:
    args = ("--model", str(model_dir), "--debug-inject-faults", "--debug-endpoints")
    with server_process(*args) as (url, proc), httpx.Client(base_url=url, timeout=60) as c:
        bad = c.post("/v1/completions", json={"prompt": f"x {REQUEST_FAULT_MARKER} y"})
        assert bad.status_code == 500 and bad.json()["error"]["code"] == "request_failed"
        body = {"prompt": f"{REQUEST_FAULT_MARKER}", "stream": True, "max_tokens": 4}
        events = [e[6:] for e in c.post("/v1/completions", json=body).text.splitlines() if e]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"]
        ok = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert c.get("/health").status_code == 200
        assert c.get("/debug/integrity").json() == {"ok": True}
        assert proc.poll() is None


def test_unattributable_fault_ends_requests_and_exits_nonzero(model_dir: Path) -> None:
    args = ("--model", str(model_dir), "--debug-inject-faults")
    with server_process(*args) as (url, proc), httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=_long_stream_body(1000)) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            fatal = c.post("/v1/completions", json={"prompt": FATAL_FAULT_MARKER})
            assert fatal.status_code >= 500
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        assert proc.wait(timeout=30) == 1
