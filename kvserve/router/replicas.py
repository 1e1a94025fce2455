"""The router's replica pool: start-up validation, health probes, loads from /metrics."""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass

import httpx

logger = logging.getLogger("kvserve.router")

_RUNNING = re.compile(r"^[\w:]*num_requests_running(?:\{[^}]*\})? (\S+)$", re.MULTILINE)
_WAITING = re.compile(r"^[\w:]*num_requests_waiting(?:\{[^}]*\})? (\S+)$", re.MULTILINE)


class ReplicaError(ValueError):
    """A replica URL that is not a kvserve / OpenAI server (raised at start-up)."""


@dataclass(slots=True)
class Replica:
    """One backend server as the router sees it."""

    url: str
    healthy: bool = True
    reported_load: int = 0  # running + waiting from its last /metrics scrape
    in_flight: int = 0  # requests the router has open on it now
    num_routed: int = 0
    num_failures: int = 0
    last_error: str = ""
    probe_failures: int = 0  # consecutive probes that timed out

    @property
    def load(self) -> int:
        """running + waiting: the scrape, or the router's own count when that is higher.

        NOTE: the scrape lags by up to a probe interval; the router's in-flight count is exact
        for its own traffic, so the larger of the two is the best estimate.
        """
        return max(self.reported_load, self.in_flight)


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port``; ValueError if empty."""
    url = url.strip().rstrip("/")
    if not url:
        raise ReplicaError("empty replica URL")
    if "://" not in url:
        url = "http://" + url
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def parse_load(metrics_text: str) -> int | None:
    """running + waiting from a Prometheus text page (kvserve: or vllm: names), or None."""
    total = 0.0
    found = False
    for pattern in (_RUNNING, _WAITING):
        for m in pattern.finditer(metrics_text):
            total += float(m.group(1))
            found = True
    return int(total) if found else None


def api_headers(api_key: str | None) -> dict[str, str]:
    """The Authorization header of ``api_key`` (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def validate_replica(
    client: httpx.AsyncClient, url: str, timeout_s: float, headers: dict[str, str] | None = None
) -> str:
    """Check that ``url`` serves the OpenAI API (GET /v1/models answers a model list).

    Returns the first model id; raises ReplicaError naming the URL and what it answered.
    """
    try:
        resp = await client.get(url + "/v1/models", timeout=timeout_s, headers=headers)
    except httpx.HTTPError as e:
        raise ReplicaError(f"replica {url} is not reachable: {e!r}") from e
    if resp.status_code != 200:
        raise ReplicaError(
            f"replica {url} is not a kvserve/OpenAI server: GET /v1/models answered "
            f"{resp.status_code} {resp.text[:200]!r}"
        )
    try:
        body = resp.json()
        data = body["data"]
        assert body.get("object") == "list" and isinstance(data, list) and data
        return str(data[0]["id"])
    except (ValueError, KeyError, TypeError, AssertionError, IndexError):
        raise ReplicaError(
            f"replica {url} is not a kvserve/OpenAI server: GET /v1/models answered "
            f"{resp.text[:200]!r}, not an OpenAI model list"
        ) from None


class ReplicaPool:
    """The replicas, their health and loads; ``probe_forever`` keeps them fresh."""

    def __init__(
        self,
        urls: list[str],
        *,
        probe_interval_s: float = 1.0,
        probe_timeout_s: float = 5.0,
        max_probe_timeouts: int = 3,
        api_key: str | None = None,
    ) -> None:
        """``api_key``: the key the replicas require, sent on the router's own calls to them
        (the start-up check, probes, metrics scrapes); clients' requests carry their own."""
        if not urls:
            raise ValueError("the router needs at least one --replica URL")
        normalized = [normalize_url(u) for u in urls]
        dupes = sorted({u for u in normalized if normalized.count(u) > 1})
        if dupes:
            raise ValueError(f"replica URL given twice: {', '.join(dupes)}")
        self.replicas = {u: Replica(u) for u in normalized}
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.max_probe_timeouts = max_probe_timeouts
        self.on_leave: list = []  # callbacks(url) when a replica leaves the pool
        self.model_id = ""
        self.headers = api_headers(api_key)

    def healthy_loads(self) -> dict[str, int]:
        """url -> load of every healthy replica."""
        return {u: r.load for u, r in self.replicas.items() if r.healthy}

    def mark_dead(self, url: str, error: str) -> None:
        """Take a replica out of the pool (it failed a request or a probe)."""
        r = self.replicas[url]
        r.last_error = error
        if r.healthy:
            logger.warning("replica %s left the pool: %s", url, error)
            r.healthy = False
            for cb in self.on_leave:
                cb(url)

    async def validate_all(self, client: httpx.AsyncClient, timeout_s: float = 10.0) -> None:
        """Start-up check of every replica (ReplicaError on the first bad one)."""
        ids = await asyncio.gather(
            *(validate_replica(client, u, timeout_s, self.headers) for u in self.replicas)
        )
        self.model_id = ids[0]

    async def probe(self, client: httpx.AsyncClient, url: str) -> None:
        """One probe: /health, then /metrics for the load.

        A refused connection or a non-200 /health takes the replica out at once; timeouts
        only after ``max_probe_timeouts`` in a row (NOTE: a replica busy with a long step on a
        loaded machine can be slow to answer without being dead). A /metrics failure only
        keeps the last load. A passing /health brings the replica back.
        """
        r = self.replicas[url]
        try:
            health = await client.get(
                url + "/health", timeout=self.probe_timeout_s, headers=self.headers
            )
        except httpx.TimeoutException as e:
            r.probe_failures += 1
            if r.probe_failures >= self.max_probe_timeouts:
                self.mark_dead(url, f"{r.probe_failures} probes timed out: {e!r}")
            return
        except httpx.HTTPError as e:
            self.mark_dead(url, f"probe failed: {e!r}")
            return
        r.probe_failures = 0
        if health.status_code != 200:
            self.mark_dead(url, f"/health answered {health.status_code}")
            return
        if not r.healthy:
            logger.warning("replica %s rejoined the pool", url)
            r.healthy = True
        try:
            metrics = await client.get(
                url + "/metrics", timeout=self.probe_timeout_s, headers=self.headers
            )
        except httpx.HTTPError:
            return
        if metrics.status_code == 200:
            load = parse_load(metrics.text)
            if load is not None:
                r.reported_load = load

    async def probe_forever(self, client: httpx.AsyncClient) -> None:
        """Probe every replica each ``probe_interval_s`` until cancelled, each on its own
        loop: a replica whose probes hang delays no other's."""

        async def loop(url: str) -> None:
            while True:
                await self.probe(client, url)
                await asyncio.sleep(self.probe_interval_s)

        await asyncio.gather(*(loop(u) for u in self.replicas))
