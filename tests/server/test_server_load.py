"""Disconnects and a short soak against one real server: no leaked request, no leaked block.

Runs in a module of its own because it checks global figures (kv_usage back to 0, the
engine's abort count) that other modules' traffic would blur.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.server_proc import metric_value, running_server, wait_idle

NUM_CLIENTS = 50
NUM_SOAK_REQUESTS = 300
SOAK_CONCURRENCY = 16


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with running_server("--debug-endpoints", "--max-num-seqs", "32") as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


def _num_aborted(http: httpx.Client) -> int:
    return int(http.get("/debug/stats").json()["num_aborted_requests"])


def _assert_healthy_and_idle(http: httpx.Client) -> None:
    wait_idle(http)
    assert http.get("/debug/integrity").json() == {"ok": True}
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


async def _stream_client(
    client: httpx.AsyncClient, i: int, close_after: int | None
) -> tuple[int, bool]:
    """Stream one completion; close the connection after ``close_after`` tokens if set.
    Returns (tokens seen, whether [DONE] was reached)."""
    body = {
        "prompt": f"Story number {i}: once upon a time",
        "max_tokens": 16,
        "temperature": 0.8,
        "seed": i,
        "ignore_eos": True,
        "stream": True,
    }
    num_tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return num_tokens, True
            chunk = json.loads(line[len("data: ") :])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                num_tokens += 1
            if close_after is not None and num_tokens >= close_after:
                return num_tokens, False  # leaving the block closes the connection
    return num_tokens, False


def test_streaming_disconnects_free_everything(base_url: str, http: httpx.Client) -> None:
    rng = random.Random(0)
    plan = [rng.randint(1, 10) if i % 2 == 0 else None for i in range(NUM_CLIENTS)]
    aborted_before = _num_aborted(http)

    async def main() -> list[tuple[int, bool]]:
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 5)
        async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
            return await asyncio.gather(
                *(_stream_client(client, i, close) for i, close in enumerate(plan))
            )

    results = asyncio.run(main())
    for (num_tokens, done), close in zip(results, plan, strict=True):
        if close is None:
            assert done and num_tokens >= 1
        else:
            assert not done and num_tokens == close
    _assert_healthy_and_idle(http)
    num_aborted = _num_aborted(http) - aborted_before
    # Every client that closed early left 6..15 tokens ungenerated: its request was aborted.
    assert num_aborted == sum(1 for c in plan if c is not None)


def test_non_streaming_disconnect_aborts(base_url: str, http: httpx.Client) -> None:
    aborted_before = _num_aborted(http)
    body = {"prompt": "Write a long essay about rivers.", "max_tokens": 1000, "ignore_eos": True}
    for _ in range(3):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base_url + "/v1/completions", json=body, timeout=1.0)
    _assert_healthy_and_idle(http)
    assert _num_aborted(http) - aborted_before == 3


def _soak_request(i: int, rng: random.Random) -> tuple[str, dict[str, Any], str]:
    """(path, body, mode) where mode is 'full', 'stream', 'cancel' or 'bad'."""
    kind = rng.random()
    common: dict[str, Any] = {"max_tokens": 4, "temperature": rng.choice([0.0, 0.7])}
    if rng.random() < 0.5:
        common["seed"] = i
    if kind < 0.08:
        return "/v1/completions", {"prompt": "x", "top_p": 2.0}, "bad"
    mode = rng.choice(["full", "stream", "stream", "cancel"])
    if rng.random() < 0.5:
        body = {"prompt": f"Shared system preamble. Question {i % 20}:", **common}
        if rng.random() < 0.2:
            body["n"] = 2
        return "/v1/completions", body, mode
    msgs = [{"role": "user", "content": f"Tell me about topic {i % 30}."}]
    return "/v1/chat/completions", {"messages": msgs, **common}, mode


def test_soak_mixed_requests(base_url: str, http: httpx.Client) -> None:
    rng = random.Random(1)
    requests = [_soak_request(i, rng) for i in range(NUM_SOAK_REQUESTS)]
    statuses: Counter[int] = Counter()

    async def one(client: httpx.AsyncClient, path: str, body: dict[str, Any], mode: str) -> None:
        if mode in ("full", "bad"):
            r = await client.post(path, json=body)
            statuses[r.status_code] += 1
            return
        async with client.stream("POST", path, json={**body, "stream": True}) as r:
            statuses[r.status_code] += 1
            async for line in r.aiter_lines():
                if mode == "cancel" and line.startswith("data: {"):
                    return  # close after the first event

    async def main() -> None:
        sem = asyncio.Semaphore(SOAK_CONCURRENCY)
        limits = httpx.Limits(max_connections=SOAK_CONCURRENCY + 4)
        async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:

            async def bounded(path: str, body: dict[str, Any], mode: str) -> None:
                async with sem:
                    await one(client, path, body, mode)

            await asyncio.gather(*(bounded(*req) for req in requests))

    asyncio.run(main())
    num_bad = sum(1 for _, _, mode in requests if mode == "bad")
    assert statuses[400] == num_bad
    assert statuses[200] == NUM_SOAK_REQUESTS - num_bad
    assert not [s for s in statuses if s >= 500]
    metrics = wait_idle(http)
    assert metric_value(metrics, "kvserve:prefix_cache_hits_total") > 0
    assert metric_value(metrics, "kvserve:e2e_request_latency_seconds_count") > 0
    _assert_healthy_and_idle(http)
