"""The router over real kvserve replicas: a replica killed mid-run, and Ray replicas."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.router.cli import build_validated_app
from kvserve.router.data_parallel import free_port, wait_healthy
from tests.router.fake_replica import serve_in_thread
from tests.server.server_proc import NO_KERNEL_TIMING, REPO_ROOT, checkout_env, metric_value

REPLICA_FLAGS = [
    "--num-threads", "1", "--num-kv-blocks", "256", "--max-num-seqs", "1", "--quiet",
    *NO_KERNEL_TIMING,
]  # fmt: skip


def _args(probe: float) -> argparse.Namespace:
    return argparse.Namespace(
        routing="prefix", balance_margin=4, max_tree_tokens=1 << 16, probe_interval=probe
    )


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[tuple[str, subprocess.Popen]]]:
    procs, urls = [], []
    for _ in range(2):
        port = free_port()
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), *REPLICA_FLAGS]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=REPO_ROOT,
                env=checkout_env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        urls.append(f"http://127.0.0.1:{port}")
    try:
        wait_healthy(urls, procs)
        yield list(zip(urls, procs, strict=True))
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=15)


def _stream(base: str, prompt: str, max_tokens: int, out: list[str], started: threading.Event):
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line:
                out.append(line)
                if '"text"' in line and len(out) >= 3:
                    started.set()
    started.set()


def test_replica_killed_mid_run(replicas: list[tuple[str, subprocess.Popen]]) -> None:
    urls = [u for u, _ in replicas]
    app = build_validated_app(urls, _args(probe=60.0))  # no probe notices the kill first
    pool = app.state.pool
    with serve_in_thread(app) as base:
        prompt = "Write a long story about a lighthouse keeper and the sea. " * 4
        a_lines: list[str] = []
        a_started = threading.Event()
        ta = threading.Thread(target=_stream, args=(base, prompt, 400, a_lines, a_started))
        ta.start()
        assert a_started.wait(120), a_lines
        victim = next(u for u in urls if pool.replicas[u].num_routed == 1)
        other = next(u for u in urls if u != victim)
        # B shares A's prefix: routed to the same replica, where it waits (max-num-seqs 1)
        b_lines: list[str] = []
        b_started = threading.Event()
        tb = threading.Thread(
            target=_stream, args=(base, prompt + "Again.", 16, b_lines, b_started)
        )
        tb.start()
        deadline = time.monotonic() + 60
        while metric_value(httpx.get(victim + "/metrics").text, "kvserve:num_requests_waiting") < 1:
            assert time.monotonic() < deadline, "B never queued on the victim"
            time.sleep(0.1)
        assert pool.replicas[victim].num_routed == 2 and not b_lines
        os.kill(dict(replicas)[victim].pid, signal.SIGKILL)
        ta.join(120)
        tb.join(120)
        # A had streamed tokens: it ends with a clear error naming the replica
        assert a_lines[-1] == "data: [DONE]"
        err = json.loads(a_lines[-2][len("data: ") :])["error"]
        assert err["code"] == "replica_failed" and victim in err["message"]
        assert any('"text"' in x for x in a_lines[:-2])
        # B had not: retried on the other replica, complete and error-free
        assert b_lines[-1] == "data: [DONE]"
        assert not any('"error"' in x for x in b_lines)
        chunks = [json.loads(x[len("data: ") :]) for x in b_lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert pool.replicas[other].num_routed == 1
        # the router stays healthy on the survivor
        health = httpx.get(base + "/health").json()
        assert health["healthy_replicas"] == [other]
        r = httpx.post(
            base + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=120
        )
        assert r.status_code == 200
        metrics = httpx.get(base + "/metrics").text
        assert "kvserve_router:failed_after_first_token_total 1.0" in metrics
        assert metric_value(metrics, "kvserve_router:retries_total") >= 1
        # A, B and the last one; B's retry is one more request sent, not one more received
        assert metric_value(metrics, "kvserve_router:client_requests_total") == 3


def test_ray_cluster_runs_two_replicas_and_the_router(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray = pytest.importorskip("ray")
    from kvserve.engine.config import EngineConfig
    from kvserve.router.data_parallel import ray_replicas
    from tests.tiny_models import make_tiny_model

    monkeypatch.setenv("PYTHONPATH", checkout_env()["PYTHONPATH"])  # actors import this checkout
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        # NOTE: a tiny model (the embedded tokenizer and chat template), no kernel selection
        # and no dtype decision: routing is what is checked. With the embedded model and a
        # cold selection the test took ~40 s alone on a 2-vCPU host, and 61-103 s beside
        # other work (Ray's processes and both actors share the two cores).
        model = make_tiny_model(tmp_path, "llama")
        config = EngineConfig(
            model=str(model),
            num_kv_blocks=128,
            num_threads=1,
            kernel_selection="off",
            dtype="float32",
        )
        actors, urls = ray_replicas(config, 2, {})
        assert len(set(urls)) == 2
        pids = ray.get([a.pid.remote() for a in actors])
        assert len(set(pids)) == 2 and os.getpid() not in pids
        # Ray's workers start at niceness 15; a replica runs at 0 (distributed/ray_actors.py).
        assert [os.getpriority(os.PRIO_PROCESS, p) for p in pids] == [0, 0]
        app = build_validated_app(urls, _args(probe=0.5))
        with serve_in_thread(app) as base:
            outs = {}
            for system in ("Speak like a pirate of old.", "Answer as a careful lawyer would."):
                for user in ("Hi", "Hello"):
                    body = {
                        "messages": [
                            {"role": "system", "content": system},
                            {"role": "user", "content": user},
                        ],
                        "max_tokens": 4,
                        "temperature": 0.0,
                    }
                    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
                    assert r.status_code == 200, r.text
                    outs[(system, user)] = r.json()["choices"][0]["message"]["content"]
            routed = [app.state.pool.replicas[u].num_routed for u in urls]
            assert sorted(routed) == [2, 2]  # one system prompt per replica
            metrics = httpx.get(base + "/metrics").text
            for u in urls:
                assert f'kvserve:generation_tokens_total{{replica="{u}"}}' in metrics
        for a in actors:
            ray.kill(a)
    finally:
        ray.shutdown()


def test_a_data_parallel_replica_that_dies_is_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvserve.engine.config import EngineConfig
    from kvserve.router.data_parallel import local_replicas
    from tests.tiny_models import make_tiny_model

    config = EngineConfig(model=str(make_tiny_model(tmp_path, "llama")), num_threads=1)
    monkeypatch.setenv("PYTHONPATH", checkout_env()["PYTHONPATH"])  # replicas run this checkout
    with local_replicas(config, 1, ["--quiet"]) as (url,):
        pid = _pid_on(url)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, "the replica was not started again"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200 and _pid_on(url) != pid:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)


def _pid_on(url: str) -> int:
    """The pid of the process listening on ``url``'s port (ps + the command line's --port)."""
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    pids = [int(ln.split()[0]) for ln in out.splitlines() if f"--port {port} " in ln + " "]
    assert len(pids) == 1, out
    return pids[0]
