"""Streaming OpenAI-API client for ``bench serve``: arrivals, concurrency, per-request timings.

Works against any OpenAI-compatible ``/v1/completions`` (kvserve, vLLM, llama.cpp's
llama-server): prompts go as token-id lists, replies stream as SSE, and the output token count
comes from the final ``usage`` chunk when the server sends one (else one token per chunk).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvserve.bench.serve_metrics import RequestRecord
from kvserve.sim.workloads import WorkloadRequest

# Which non-OpenAI sampling fields each server understands (to make output lengths match).
BACKENDS = ("auto", "kvserve", "vllm", "llama.cpp", "openai")


@dataclass(frozen=True)
class ClientConfig:
    """How to send the trace."""

    base_url: str
    model: str | None = None
    backend: str = "auto"
    request_rate: float = math.inf  # requests/s; inf = all at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1.0 = Poisson
    max_concurrency: int | None = None
    static_batch_size: int | None = None  # static batching by the client (see run_client)
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not self.request_rate > 0:
            raise ValueError(
                f"request_rate must be > 0 (inf = all at once), got {self.request_rate}"
            )
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.static_batch_size is not None:
            if self.static_batch_size < 1:
                raise ValueError(f"static_batch_size must be >= 1, got {self.static_batch_size}")
            if self.max_concurrency is not None:
                raise ValueError("static_batch_size and max_concurrency exclude each other")


def arrival_gaps(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: 0 for the first, then Gamma(k, 1/(rate*k)) gaps.

    ``k = burstiness``: 1.0 is a Poisson process, < 1 burstier, > 1 more regular; the mean
    gap is always 1/rate. ``rate = inf`` gives all zeros.
    """
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    gaps = [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(num)]
    if gaps:
        gaps[0] = 0.0
    return gaps


def request_body(cfg: ClientConfig, model: str, req: WorkloadRequest, backend: str) -> dict:
    """The JSON body of one streaming completion request."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": req.prompt_token_ids,
        "max_tokens": req.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos and backend != "openai":
        # NOTE: kvserve and vLLM take both; llama-server knows ignore_eos only (and ignores
        # unknown fields). The plain OpenAI API rejects both, hence backend "openai".
        body["ignore_eos"] = True
        if backend != "llama.cpp":
            body["min_tokens"] = req.output_len
    body.update(cfg.extra_body)
    return body


async def resolve_model(client: httpx.AsyncClient, cfg: ClientConfig) -> str:
    """``cfg.model``, else the first id that ``GET /v1/models`` lists."""
    if cfg.model:
        return cfg.model
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{cfg.base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


async def _one(
    client: httpx.AsyncClient,
    cfg: ClientConfig,
    model: str,
    req: WorkloadRequest,
    clock: Callable[[], float],
    arrival: float | None = None,
) -> RequestRecord:
    body = request_body(cfg, model, req, cfg.backend)
    # NOTE: a request held back by the client (static batching) counts from its arrival.
    send_time = clock() if arrival is None else arrival
    rec = RequestRecord(req.request_id, req.prompt_len, req.output_len, send_time=send_time)
    num_chunks = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:200]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                now = clock()
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens", usage_tokens)
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        rec.chunk_times.append(now)
                        num_chunks += 1
                        break
        rec.end_time = clock()
        rec.num_output_tokens = usage_tokens if usage_tokens is not None else num_chunks
        rec.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def run_client(
    cfg: ClientConfig,
    requests: list[WorkloadRequest],
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[RequestRecord], float]:
    """Send ``requests`` by the arrival process; returns (records in trace order, duration_s).

    The duration runs from the first send to the last response's end. With
    ``cfg.static_batch_size = N`` the client batches statically: it sends the requests that
    have arrived (up to N; the first one waited for if none has) all at once and the next
    batch only once every one of them is done; TTFT and e2e count from each request's arrival.
    """
    limits = httpx.Limits(max_connections=max(len(requests), 1), max_keepalive_connections=64)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    async with httpx.AsyncClient(
        base_url=cfg.base_url.rstrip("/"),
        timeout=httpx.Timeout(cfg.timeout_s),
        limits=limits,
        headers=headers,
        trust_env=False,  # NOTE: a proxy from the environment must not sit between us and 127.0.0.1
    ) as client:
        model = await resolve_model(client, cfg)
        sem = asyncio.Semaphore(cfg.max_concurrency or len(requests) or 1)

        async def limited(req: WorkloadRequest) -> RequestRecord:
            async with sem:
                return await _one(client, cfg, model, req, clock)

        gaps = arrival_gaps(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
        tasks: list[asyncio.Task[RequestRecord]] = []
        start = clock()
        if cfg.static_batch_size is not None:
            records = await _run_static(client, cfg, model, requests, gaps, clock, start)
        else:
            for gap, req in zip(gaps, requests, strict=True):
                if gap > 0:
                    await asyncio.sleep(gap)
                tasks.append(asyncio.create_task(limited(req)))
            records = list(await asyncio.gather(*tasks))
    ends = [r.end_time for r in records if r.end_time is not None]
    duration = (max(ends) if ends else clock()) - start
    return records, duration


async def _run_static(
    client: httpx.AsyncClient,
    cfg: ClientConfig,
    model: str,
    requests: list[WorkloadRequest],
    gaps: list[float],
    clock: Callable[[], float],
    start: float,
) -> list[RequestRecord]:
    """Static batches of up to ``cfg.static_batch_size`` arrived requests, one after another."""
    size = cfg.static_batch_size or 1
    arrivals = []
    t = 0.0
    for g in gaps:
        t += g
        arrivals.append(start + t)
    records: list[RequestRecord] = []
    i = 0
    while i < len(requests):
        wait = arrivals[i] - clock()
        if wait > 0:
            await asyncio.sleep(wait)
        now = clock()
        j = i + 1
        while j < len(requests) and j - i < size and arrivals[j] <= now:
            j += 1
        batch = [_one(client, cfg, model, requests[k], clock, arrivals[k]) for k in range(i, j)]
        records.extend(await asyncio.gather(*batch))
        i = j
    return records
