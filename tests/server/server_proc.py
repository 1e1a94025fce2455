"""Start a real ``kvserve serve`` process on a free loopback port for a test module."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 180.0

# NOTE: the two requests of a streaming/non-streaming comparison carry these, a cache_salt
# each, so neither reuses the other's prompt blocks: both then run the same steps. With a
# prefix hit the second would decode from a 1-token step where the first ran a whole prompt,
# and in the default bf16 (quantized weights, the kernel chosen per row count) that rounds
# differently and can flip a greedy near-tie (seen on the AMX Xeon, 2026-12-04). Streaming is
# what those tests check; tests/e2e/test_equivalence.py checks what the cache may change.
FRESH_A = {"cache_salt": "streaming-check-a"}
FRESH_B = {"cache_salt": "streaming-check-b"}

# NOTE: no kernel timing at start-up (a cold one took ~35 s of a 49 s first start on a 2-vCPU
# host): the server and router tests check HTTP and routing; tests/e2e checks the kernels.
NO_KERNEL_TIMING = ("--kernel-selection", "off", "--dtype", "float32")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve_command() -> list[str]:
    # NOTE: `python -m` with the repo root on PYTHONPATH runs this checkout's code; the venv's
    # console script would import whichever kvserve is installed.
    return [sys.executable, "-m", "kvserve.cli", "serve"]


def checkout_env() -> dict[str, str]:
    """os.environ with this checkout first on PYTHONPATH."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT) + (os.pathsep + path if path else "")}


@contextmanager
def running_server(*extra_args: str, api_key: str | None = None) -> Iterator[str]:
    """Run the server until the block exits; yields its base URL (http://127.0.0.1:PORT).

    The process is always terminated (then killed) on exit, and its log is shown on a
    start-up failure.
    """
    with server_process(*extra_args, api_key=api_key) as (base_url, _proc):
        yield base_url


@contextmanager
def server_process(
    *extra_args: str, api_key: str | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """As running_server, but yields (base URL, the process) for signal and exit tests."""
    port = free_port()
    cmd = [
        *_serve_command(),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--num-kv-blocks", "512",
        "--num-threads", "1",
        "--quiet",
        *NO_KERNEL_TIMING,
        *extra_args,
    ]  # fmt: skip
    if api_key is not None:
        cmd += ["--api-key", api_key]
    log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-test-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=checkout_env()
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{_read(log)}")
            try:
                if httpx.get(base_url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{_read(log)}")
            time.sleep(0.25)
        yield base_url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        log.close()
        os.unlink(log.name)


def _read(log: tempfile._TemporaryFileWrapper) -> str:  # type: ignore[type-arg]
    log.flush()
    log.seek(0)
    return log.read()[-5000:]


def metric_value(metrics_text: str, name: str) -> float:
    """The value of an unlabelled sample ``name`` in Prometheus text format."""
    m = re.search(rf"^{re.escape(name)} (\S+)$", metrics_text, re.MULTILINE)
    if m is None:
        raise AssertionError(f"metric {name} not found")
    return float(m.group(1))


def wait_idle(client: httpx.Client, timeout_s: float = 60.0) -> str:
    """Poll /metrics until no request is running or waiting and kv_usage is 0; returns it."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = client.get("/metrics").text
        busy = (
            metric_value(text, "kvserve:num_requests_running"),
            metric_value(text, "kvserve:num_requests_waiting"),
            metric_value(text, "kvserve:kv_usage"),
        )
        if busy == (0.0, 0.0, 0.0):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout_s} s: {busy}")
        time.sleep(0.2)
