"""The router: one OpenAI endpoint in front of data-parallel replicas (FastAPI + httpx).

Each request is routed by the policy (``kvserve/router/policy.py``) on its prefix key, sent to
that replica, and its answer passed through (SSE streams chunk by chunk). A replica that
fails (connection error, a 5xx ``engine_dead`` answer, a stream cut short) leaves the pool; a
request that has not streamed a token yet is retried on another replica, one that has gets
an SSE error event naming the replica. The pool's probes bring a replica back.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.cors import allow_cross_origin
from kvserve.router.keys import request_key
from kvserve.router.policy import RoutingPolicy
from kvserve.router.replicas import ReplicaPool
from kvserve.server.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES
from kvserve.server.request_guard import RequestGuard

logger = logging.getLogger("kvserve.router")

_FORWARD_HEADERS = ("authorization", "content-type", "accept")
_DONE = "data: [DONE]"
_T = TypeVar("_T")


class _StreamFailed(Exception):
    """A replica's stream broke (cut short, or an engine_dead error event)."""


def error_body(message: str, *, code: str, type_: str = "server_error") -> dict[str, Any]:
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def _is_engine_dead(status: int, text: str) -> bool:
    return status >= 500 and "engine_dead" in text


def _is_busy(status: int, text: str) -> bool:
    """A replica's 503 for a full queue: another replica may have room (it is not dead)."""
    return status == 503 and "queue_full" in text


def _event_has_token(event: str) -> bool:
    """Whether an SSE event carries generated text (or a finish) for the client."""
    if not event.startswith("data: ") or event.startswith(_DONE):
        return False
    try:
        payload = json.loads(event[len("data: ") :])
    except ValueError:
        return True
    for choice in payload.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or choice.get("finish_reason"):
            return True
        if delta.get("content") or delta.get("tool_calls"):
            return True
    return False


def _event_is_dead(event: str) -> bool:
    return event.startswith("data: ") and '"error"' in event and "engine_dead" in event


async def _wait_disconnect(request: Request) -> None:
    """Return once the client has gone (its body already read: receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _ClientGone(Exception):
    """The client disconnected while the router waited on a replica for it."""


async def _unless_gone(request: Request, work: Awaitable[_T]) -> _T:
    """``await work``, cancelled (raising _ClientGone) if the client leaves first.

    NOTE: cancelling the replica call drops its connection, which the replica answers by
    aborting the request, as it does for a client of its own that leaves.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        with suppress(asyncio.CancelledError, httpx.HTTPError):
            await task
        raise _ClientGone
    return task.result()


def _passed_headers(resp: httpx.Response) -> dict[str, str]:
    """The replica's headers a client acts on (``Retry-After`` of a 503)."""
    return {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}


async def _events(resp: httpx.Response) -> AsyncIterator[str]:
    """SSE events (their ``data:`` lines joined) of a streaming response."""
    lines: list[str] = []
    async for line in resp.aiter_lines():
        if line:
            lines.append(line)
        elif lines:
            yield "\n".join(lines)
            lines = []
    if lines:
        yield "\n".join(lines)


class RouterMetrics(Collector):
    """Router counters plus every replica's /metrics, each sample labelled ``replica``."""

    def __init__(self, pool: ReplicaPool, policy_name: str) -> None:
        self.pool = pool
        self.registry = CollectorRegistry(auto_describe=False)
        self.client_requests = Counter(
            "kvserve_router:client_requests", "Requests received on the proxied routes",
            registry=self.registry,
        )  # fmt: skip
        # NOTE: per attempt: a request retried elsewhere counts on every replica it was
        # sent to, so its sum is client_requests plus the retries, not the clients' count.
        self.requests = Counter(
            "kvserve_router:requests", "Requests sent to a replica (each attempt)",
            ["replica", "routing"], registry=self.registry,
        )  # fmt: skip
        self.retries = Counter(
            "kvserve_router:retries", "Requests retried on another replica before any token",
            registry=self.registry,
        )  # fmt: skip
        self.failed_streams = Counter(
            "kvserve_router:failed_after_first_token",
            "Streams whose replica failed after tokens were sent (answered with an error event)",
            registry=self.registry,
        )  # fmt: skip
        self.prefix_matched = Counter(
            "kvserve_router:prefix_matched_elements",
            "Key elements (token ids or prompt bytes) matched in the prefix tree",
            registry=self.registry,
        )  # fmt: skip
        self.policy_name = policy_name
        self.replica_pages: dict[str, str] = {}
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            "kvserve_router:replica_healthy", "1 if the replica is in the pool", labels=["replica"]
        )
        load = GaugeMetricFamily(
            "kvserve_router:replica_load", "running + waiting as the router sees it",
            labels=["replica"],
        )  # fmt: skip
        for url, r in self.pool.replicas.items():
            healthy.add_metric([url], 1.0 if r.healthy else 0.0)
            load.add_metric([url], float(r.load))
        yield healthy
        yield load
        yield from _merge_replica_pages(self.replica_pages)


def _merge_replica_pages(pages: dict[str, str]) -> Iterator[Metric]:
    """One family per metric name, the replica's samples labelled with its URL."""
    merged: dict[str, Metric] = {}
    for url, text in pages.items():
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:
            continue
        for fam in families:
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type)
            for s in fam.samples:
                out.add_sample(s.name, {"replica": url, **s.labels}, s.value)
    yield from merged.values()


def build_router_app(
    pool: ReplicaPool,
    policy: RoutingPolicy,
    *,
    connect_timeout_s: float = 5.0,
    request_timeout_s: float | None = None,
    allowed_origins: Sequence[str] = (),
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
) -> FastAPI:
    """The router app over ``pool`` (already validated) with ``policy``; browsers on
    ``allowed_origins`` may call it (CORS). A body over ``max_request_bytes`` is a 413 and
    one not all in within ``body_timeout_s`` a 408, before anything is routed (the server's
    request guard, without its API-key check: clients' keys pass through to the replicas)."""
    metrics = RouterMetrics(pool, policy.name)
    pool.on_leave.append(policy.remove_replica)
    state: dict[str, Any] = {}
    timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            state["client"] = client
            probe = asyncio.create_task(pool.probe_forever(client))
            try:
                yield
            finally:
                probe.cancel()
                with suppress(asyncio.CancelledError):
                    await probe

    app = FastAPI(title="kvserve router", lifespan=lifespan)
    app.state.pool = pool
    app.state.policy = policy
    app.state.metrics = metrics

    def no_replica(tried: list[str]) -> JSONResponse:
        detail = f" (failed: {', '.join(tried)})" if tried else ""
        return JSONResponse(
            error_body(f"no healthy replica to serve the request{detail}", code="no_replica"),
            status_code=503,
        )

    def pick(key: list[int], tried: list[str]) -> str | None:
        loads = {u: v for u, v in pool.healthy_loads().items() if u not in tried}
        if not loads:
            return None
        url = policy.choose(key, loads)
        policy.on_routed(url, key)
        metrics.prefix_matched.inc(getattr(policy, "last_match_len", 0))
        metrics.requests.labels(url, policy.name).inc()
        pool.replicas[url].num_routed += 1
        return url

    @app.get("/health")
    @app.head("/health", include_in_schema=False)
    async def health() -> Response:
        healthy = [u for u, r in pool.replicas.items() if r.healthy]
        if not healthy:
            return JSONResponse(
                error_body("no healthy replica", code="no_replica"), status_code=503
            )
        return JSONResponse({"status": "ok", "healthy_replicas": healthy})

    async def forward_get(request: Request, path: str) -> Response:
        """A GET answered by any healthy replica (least loaded first), passed through."""
        client: httpx.AsyncClient = state["client"]
        loads = pool.healthy_loads()
        for url in sorted(loads, key=loads.__getitem__):
            try:
                resp = await client.get(url + path, headers=_headers(request))
            except httpx.HTTPError as e:
                pool.mark_dead(url, repr(e))
                continue
            return Response(
                resp.content,
                resp.status_code,
                media_type=resp.headers.get("content-type", "application/json"),
            )
        return no_replica([])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await forward_get(request, "/v1/models")

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        return await forward_get(request, f"/v1/models/{model_id}")

    @app.get("/version")
    async def version(request: Request) -> Response:
        return await forward_get(request, "/version")

    @app.get("/metrics")
    async def prometheus() -> Response:
        client: httpx.AsyncClient = state["client"]

        async def scrape(url: str) -> tuple[str, str | None]:
            try:
                resp = await client.get(url + "/metrics", timeout=5.0, headers=pool.headers)
            except httpx.HTTPError:
                return url, None
            return url, resp.text if resp.status_code == 200 else None

        pages = await asyncio.gather(*(scrape(u) for u in pool.healthy_loads()))
        metrics.replica_pages = {u: t for u, t in pages if t is not None}
        return Response(
            generate_latest(metrics.registry),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    async def proxy(request: Request, path: str) -> Response:
        client: httpx.AsyncClient = state["client"]
        metrics.client_requests.inc()
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None  # the replica says what is wrong with it (a 400)
        key = request_key(body) if isinstance(body, dict) else []
        stream = isinstance(body, dict) and body.get("stream") is True
        headers = _headers(request)
        tried: list[str] = []
        busy: Response | None = None  # the last "queue full" 503, answered if all are full
        while True:
            url = pick(key, tried)
            if url is None:
                return busy if busy is not None else no_replica(tried)
            replica = pool.replicas[url]
            replica.in_flight += 1
            try:
                req = client.build_request("POST", url + path, content=raw, headers=headers)
                resp = await _unless_gone(request, client.send(req, stream=True))
            except httpx.HTTPError as e:
                replica.in_flight -= 1
                _fail(url, f"{path} failed: {e!r}", tried)
                continue
            except _ClientGone:
                replica.in_flight -= 1
                return Response(status_code=499)  # nobody reads this
            if resp.status_code != 200 or not stream:
                try:
                    content = await _unless_gone(request, resp.aread())
                except httpx.HTTPError as e:
                    _fail(url, f"{path} broke off: {e!r}", tried)
                    continue
                except _ClientGone:
                    return Response(status_code=499)
                finally:
                    replica.in_flight -= 1
                    await resp.aclose()
                text = content.decode(errors="replace")
                if _is_engine_dead(resp.status_code, text):
                    _fail(url, f"{path} answered {resp.status_code} engine_dead", tried)
                    continue
                answer = Response(
                    content,
                    resp.status_code,
                    headers=_passed_headers(resp),
                    media_type=resp.headers.get("content-type", "application/json"),
                )
                if _is_busy(resp.status_code, text):
                    busy = answer
                    tried.append(url)  # not dead: another replica may have room
                    continue
                return answer
            return StreamingResponse(
                _stream(client, url, resp, raw, headers, path, key, tried),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )

    def _fail(url: str, error: str, tried: list[str]) -> None:
        pool.mark_dead(url, error)
        pool.replicas[url].num_failures += 1
        tried.append(url)
        metrics.retries.inc()

    async def _stream(
        client: httpx.AsyncClient,
        url: str,
        resp: httpx.Response,
        raw: bytes,
        headers: dict[str, str],
        path: str,
        key: list[int],
        tried: list[str],
    ) -> AsyncIterator[str]:
        started = False
        while True:
            buffered: list[str] = []
            done = False
            try:
                async for event in _events(resp):
                    if _event_is_dead(event):
                        raise _StreamFailed(f"error event {event[:300]}")
                    done = done or event.startswith(_DONE)
                    if started:
                        yield event + "\n\n"
                        continue
                    buffered.append(event + "\n\n")
                    if _event_has_token(event) or done:
                        started = True
                        for e in buffered:
                            yield e
                if not done:
                    raise _StreamFailed("the stream ended without [DONE]")
                return
            except (httpx.HTTPError, _StreamFailed) as e:
                pool.mark_dead(url, f"stream from {url} failed: {e!r}")
                pool.replicas[url].num_failures += 1
                if started:
                    metrics.failed_streams.inc()
                    msg = (
                        f"replica {url} failed after this response had started streaming "
                        f"({e!r}); the request cannot be resumed elsewhere"
                    )
                    yield "data: " + json.dumps(error_body(msg, code="replica_failed")) + "\n\n"
                    yield _DONE + "\n\n"
                    return
                tried.append(url)
                metrics.retries.inc()
            finally:
                pool.replicas[url].in_flight -= 1
                await resp.aclose()
            # retry before the first token: open the stream on another replica
            while True:
                nxt = pick(key, tried)
                if nxt is None:
                    msg = f"no healthy replica to serve the request (failed: {', '.join(tried)})"
                    yield "data: " + json.dumps(error_body(msg, code="no_replica")) + "\n\n"
                    yield _DONE + "\n\n"
                    return
                pool.replicas[nxt].in_flight += 1
                try:
                    req = client.build_request("POST", nxt + path, content=raw, headers=headers)
                    resp = await client.send(req, stream=True)
                except httpx.HTTPError as e:
                    pool.replicas[nxt].in_flight -= 1
                    _fail(nxt, f"{path} failed: {e!r}", tried)
                    continue
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    pool.replicas[nxt].in_flight -= 1
                    await resp.aclose()
                    if _is_engine_dead(resp.status_code, text):
                        _fail(nxt, f"{path} answered {resp.status_code} engine_dead", tried)
                        continue
                    yield f"data: {text}\n\n"
                    yield _DONE + "\n\n"
                    return
                url = nxt
                break

    def proxied(path: str) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            return await proxy(request, path)

        return route

    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        app.add_api_route(path, proxied(path), methods=["POST"])

    async def http_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        code = "not_found" if exc.status_code == 404 else "invalid_request"
        body = error_body(str(exc.detail), code=code, type_="invalid_request_error")
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_middleware(
        RequestGuard, max_request_bytes=max_request_bytes, body_timeout=body_timeout_s
    )
    allow_cross_origin(app, allowed_origins)
    return app


def _headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
