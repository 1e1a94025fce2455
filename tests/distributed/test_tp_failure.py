"""A worker that hangs or dies: collectives time out or fail, requests end with a clear error,
the server reports itself unhealthy, and nothing hangs."""

from __future__ import annotations

import os
import signal
import time

import pytest
from fastapi.testclient import TestClient

from kvserve.distributed.comm import TIMEOUT_ENV, TPCollectiveError
from kvserve.distributed.sharding import OVERSUBSCRIBE_ENV
from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams
from kvserve.server.app import build_app
from tests.tiny_models import make_tiny_model

TIMEOUT_S = 8


@pytest.fixture
def tiny(tmp_path, monkeypatch: pytest.MonkeyPatch) -> str:  # noqa: ANN001
    monkeypatch.setenv(OVERSUBSCRIBE_ENV, "1")
    monkeypatch.setenv(TIMEOUT_ENV, str(TIMEOUT_S))
    return str(make_tiny_model(tmp_path, "llama"))


def test_hung_worker_fails_requests_and_health(tiny: str) -> None:
    llm = LLM(model=tiny, tensor_parallel_size=2, num_threads=1, num_kv_blocks=64)
    engine = llm.engine
    worker = engine.tp.procs[0]
    try:
        with TestClient(build_app(engine)) as client:
            body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0.0}
            assert client.post("/v1/completions", json=body).status_code == 200
            os.kill(worker.pid, signal.SIGSTOP)  # hung, not dead
            t0 = time.monotonic()
            r = client.post("/v1/completions", json=body)
            waited = time.monotonic() - t0
            assert r.status_code >= 500
            message = r.json()["error"]["message"]
            assert "tensor-parallel" in message and "the engine is stopped" in message
            assert waited < TIMEOUT_S * 4  # the collective timed out; nothing hung
            health = client.get("/health")
            assert health.status_code == 503
            assert "tensor-parallel" in health.json()["error"]["message"]
            # later requests fail at once
            assert client.post("/v1/completions", json=body).status_code >= 500
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        engine.tp.shutdown()


def test_dead_worker_fails_offline_generate(tiny: str) -> None:
    llm = LLM(model=tiny, tensor_parallel_size=2, num_threads=1, num_kv_blocks=64)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4)
    try:
        assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        worker = engine.tp.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        with pytest.raises(TPCollectiveError, match="tensor-parallel .* failed.*kvserve-tp-1"):
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
        with pytest.raises(TPCollectiveError, match="the tensor-parallel group is down"):
            llm.generate([[9, 9]], params, use_tqdm=False)
    finally:
        engine.tp.shutdown()
