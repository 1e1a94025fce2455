"""``kvserve bench soak``: one server, thousands of mixed requests, faults among them.

Starts ``kvserve serve --debug-inject-faults --debug-endpoints`` on a free loopback port (or
uses ``--url``), then:

1. warm-up, then the server's RSS;
2. a fault-free pass of the mix (the baseline), then the same mix with ``--fault-fraction``
   of the requests replaced by injected faults (a prompt with KVSERVE_INJECT_FAULT) or fuzzed
   parameters (float32-breaking penalties, NaN, lone surrogates, huge n, ...); both passes
   stream, use n > 1, chat and cancel mid-stream;
3. once idle: zero leaked blocks (kv_usage 0, every block free, /debug/integrity ok), RSS
   growth, 5xx answers other than the injected faults' own, p99 latency of the unfaulted
   requests against the baseline's;
4. the drain: a long stream (``--drain-tokens``) in flight, SIGTERM, time until the process
   exits (must be within ``--shutdown-timeout``, plus 0.25 s for the signal and the reaping)
   and its exit code.

Prints one JSON record and exits 1 if a target is missed. Loopback only; every loop bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

MODES = ("stream", "plain", "chat", "n", "cancel")


@dataclass
class Outcome:
    """What one request of the soak got."""

    index: int
    kind: str  # a MODES entry, "fault" or "fuzz"
    status: int = 0  # HTTP status (0: no answer)
    error_event: bool = False  # a stream that ended with an error event
    seconds: float = 0.0
    note: str = ""


@dataclass
class SoakResult:
    """The soak's figures (one JSON record)."""

    num_requests: int
    counts: dict[str, int] = field(default_factory=dict)
    unexpected_5xx: list[str] = field(default_factory=list)
    hangs: int = 0
    p99_unfaulted_s: float = 0.0
    p99_baseline_s: float = 0.0
    p99_ratio: float = 0.0
    rss_start_mib: float = 0.0
    rss_end_mib: float = 0.0
    rss_growth_mib: float = 0.0
    leaked_blocks: int = 0
    integrity_ok: bool = False
    small_alone_s: float = 0.0  # mean latency of small requests, alone
    small_beside_huge_s: float = 0.0  # ... while a huge prompt is being tokenized
    huge_prompt_status: int = 0
    huge_prompt_s: float = 0.0
    drain_seconds: float | None = None
    drain_exit_code: int | None = None
    drain_stream_ended_with_error: bool = False
    failures: list[str] = field(default_factory=list)


def _fuzzed_body(rng: random.Random, model: str) -> tuple[dict[str, Any] | str, str]:
    """A request with parameters meant to break things; returns (JSON body or raw text, note)."""
    base: dict[str, Any] = {"model": model, "prompt": "Tell me a story", "max_tokens": 8}
    choices: list[tuple[dict[str, Any], str]] = [
        ({"repetition_penalty": 1e-40, "temperature": 1.0}, "repetition_penalty 1e-40"),
        ({"repetition_penalty": 1e30}, "repetition_penalty 1e30"),
        ({"temperature": 1e30, "min_tokens": 4}, "temperature 1e30"),
        ({"top_p": 1e-300, "temperature": 0.7}, "top_p 1e-300"),
        ({"min_p": 1.0, "temperature": 2.0}, "min_p 1"),
        ({"top_k": 10**12}, "top_k 1e12"),
        ({"n": 10**6}, "n 1e6"),
        ({"n": 65}, "n 65"),
        ({"max_tokens": 10**9}, "max_tokens 1e9"),
        ({"seed": -1}, "seed -1"),
        ({"prompt": [10**9]}, "token id 1e9"),
        ({"presence_penalty": 2.0, "frequency_penalty": -2.0, "temperature": 1.5}, "penalties"),
        ({"logprobs": 20, "temperature": 1.3, "top_k": 1}, "logprobs 20"),
    ]
    raw: list[tuple[str, str]] = [
        ('{"prompt": "x\\ud800y", "max_tokens": 4}', "lone surrogate"),
        ('{"prompt": "hi", "temperature": NaN}', "NaN"),
        ('{"prompt": ' + "[" * 300 + "]" * 300 + "}", "deep nesting"),
        ('{"prompt": "hi", "max_tokens": 1' + "0" * 3000 + "}", "huge number"),
        ('{"prompt": "hi"', "truncated JSON"),
    ]
    if rng.random() < 0.3:
        body, note = rng.choice(raw)
        return body, note
    extra, note = rng.choice(choices)
    return {**base, **extra}, note


def _body(kind: str, rng: random.Random, model: str, index: int) -> dict[str, Any]:
    max_tokens = rng.randint(4, 24)
    prompt = f"Request {index}: write about the number {rng.randint(0, 10**6)}."
    if kind == "chat":
        return {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": True,
            "temperature": 0.7,
        }
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": rng.choice([0.0, 0.8]),
        "stream": kind in ("stream", "cancel"),
    }
    if kind == "n":
        body["n"] = rng.randint(2, 4)
        body["seed"] = index
    return body


async def _one(
    client: httpx.AsyncClient, kind: str, body: dict[str, Any] | str, index: int, timeout: float
) -> Outcome:
    out = Outcome(index=index, kind=kind)
    path = (
        "/v1/chat/completions"
        if isinstance(body, dict) and "messages" in body
        else ("/v1/completions")
    )
    kwargs: dict[str, Any] = (
        {"json": body}
        if isinstance(body, dict)
        else {"content": body.encode(), "headers": {"content-type": "application/json"}}
    )
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            streaming = isinstance(body, dict) and body.get("stream")
            if not streaming:
                r = await client.post(path, **kwargs)
                out.status = r.status_code
            else:
                async with client.stream("POST", path, **kwargs) as r:
                    out.status = r.status_code
                    num_events = 0
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        num_events += 1
                        if '"error"' in line[:20]:
                            out.error_event = True
                        if kind == "cancel" and num_events >= 2:
                            break  # the client goes away mid-stream
    except TimeoutError:
        out.note = "timeout"
    except httpx.HTTPError as e:
        out.note = f"transport: {e!r}"
    out.seconds = time.monotonic() - t0
    return out


async def _pass(
    url: str,
    model: str,
    plan: list[tuple[str, dict[str, Any] | str]],
    concurrency: int,
    timeout: float,
) -> list[Outcome]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def run(i: int, kind: str, body: dict[str, Any] | str) -> Outcome:
            async with sem:
                return await _one(client, kind, body, i, timeout)

        return list(await asyncio.gather(*(run(i, k, b) for i, (k, b) in enumerate(plan))))


def _plan(num: int, fault_fraction: float, seed: int, model: str, faults: bool) -> list:
    rng = random.Random(seed)
    weights = {"stream": 0.35, "plain": 0.2, "chat": 0.15, "n": 0.15, "cancel": 0.15}
    plan: list[tuple[str, dict[str, Any] | str]] = []
    for i in range(num):
        roll = rng.random()
        kind = rng.choices(list(weights), weights=list(weights.values()))[0]
        body: dict[str, Any] | str = _body(kind, rng, model, i)
        # NOTE: every draw happens in both passes, so their other requests are identical.
        fuzz_body, _note = _fuzzed_body(rng, model)
        fault_body = {**_body("plain", rng, model, i), "prompt": f"KVSERVE_INJECT_FAULT {i}"}
        fault_body["stream"] = i % 2 == 0
        if faults and roll < fault_fraction / 2:
            kind, body = "fault", fault_body
        elif faults and roll < fault_fraction:
            kind, body = "fuzz", fuzz_body
        plan.append((kind, body))
    return plan


def _p99(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise ValueError(f"metric {name} missing")


def _wait_idle(client: httpx.Client, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = client.get("/metrics").text
        busy = [
            _metric(text, f"kvserve:{n}")
            for n in ("num_requests_running", "num_requests_waiting", "kv_usage")
        ]
        if busy == [0.0, 0.0, 0.0] or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "kvserve.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--quiet",
        "--debug-inject-faults",
        "--debug-endpoints",
        "--shutdown-timeout",
        str(args.shutdown_timeout),
        *args.server_arg,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become healthy in 600 s")


async def _huge_prompt(url: str, model: str, res: SoakResult, num_bytes: int) -> None:
    """Small requests alone, then beside one whose prompt is ``num_bytes`` of text."""
    small = {"model": model, "prompt": "Hello there", "max_tokens": 8, "temperature": 0.0}
    huge = {
        "model": model,
        "prompt": "lorem ipsum dolor sit amet " * (num_bytes // 27),
        "max_tokens": 1,
    }
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def timed(body: dict[str, Any]) -> tuple[int, float]:
            t0 = time.monotonic()
            r = await client.post("/v1/completions", json=body)
            return r.status_code, time.monotonic() - t0

        alone = [await timed(small) for _ in range(4)]
        res.small_alone_s = sum(t for _, t in alone) / len(alone)
        big = asyncio.ensure_future(timed(huge))
        await asyncio.sleep(0.2)  # the huge prompt is being read and tokenized
        beside = [await timed(small) for _ in range(4)]
        res.small_beside_huge_s = sum(t for _, t in beside) / len(beside)
        res.huge_prompt_status, res.huge_prompt_s = await big


def _drain(
    proc: subprocess.Popen, url: str, model: str, args: argparse.Namespace, res: SoakResult
) -> None:
    body = {
        "model": model,
        "prompt": "Write a very long story.",
        "max_tokens": args.drain_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=url, timeout=args.shutdown_timeout + 120) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    break  # generating
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            last = [line for line in lines if line.startswith("data: ")][-2:]
        res.drain_stream_ended_with_error = (
            len(last) == 2 and last[1] == "data: [DONE]" and '"error"' in last[0]
        )
    res.drain_exit_code = proc.wait(timeout=args.shutdown_timeout + 120)
    res.drain_seconds = time.monotonic() - t0


def run(args: argparse.Namespace) -> SoakResult:
    """Run the soak (see the module docstring)."""
    proc, url = _start_server(args) if args.url is None else (None, args.url)
    res = SoakResult(num_requests=args.num_requests)
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            warm = _plan(args.warmup, 0.0, args.seed + 1, model, faults=False)
            asyncio.run(_pass(url, model, warm, args.concurrency, args.request_timeout))
            _wait_idle(client)
            if proc is not None:
                res.rss_start_mib = _rss_mib(proc.pid)
            base = _plan(args.num_requests, args.fault_fraction, args.seed, model, faults=False)
            soak = _plan(args.num_requests, args.fault_fraction, args.seed, model, faults=True)
            baseline = asyncio.run(_pass(url, model, base, args.concurrency, args.request_timeout))
            faulted = asyncio.run(_pass(url, model, soak, args.concurrency, args.request_timeout))
            metrics = _wait_idle(client)
            if proc is not None:
                res.rss_end_mib = _rss_mib(proc.pid)
                res.rss_growth_mib = res.rss_end_mib - res.rss_start_mib
            res.leaked_blocks = int(
                _metric(metrics, "kvserve:num_kv_blocks")
                - _metric(metrics, "kvserve:num_free_blocks")
            )
            res.integrity_ok = client.get("/debug/integrity").json().get("ok") is True
            if args.huge_prompt_bytes > 0:
                asyncio.run(_huge_prompt(url, model, res, args.huge_prompt_bytes))
        _judge(res, baseline, faulted)
        if proc is not None and args.drain_tokens > 0:
            _drain(proc, url, model, args, res)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
    _targets(res, args)
    return res


def _judge(res: SoakResult, baseline: list[Outcome], faulted: list[Outcome]) -> None:
    for o in faulted:
        key = f"{o.kind}:{o.status}" + (":error_event" if o.error_event else "")
        res.counts[key] = res.counts.get(key, 0) + 1
        if o.note == "timeout":
            res.hangs += 1
        if o.status >= 500 and o.kind != "fault":
            res.unexpected_5xx.append(f"#{o.index} {o.kind} -> {o.status} {o.note}")
        if o.kind not in ("fault", "fuzz") and o.error_event:
            res.unexpected_5xx.append(f"#{o.index} {o.kind}: error event")
    res.hangs += sum(o.note == "timeout" for o in baseline)
    clean = {o.index for o in faulted if o.kind in MODES and o.kind != "cancel"}
    res.p99_unfaulted_s = _p99([o.seconds for o in faulted if o.index in clean])
    res.p99_baseline_s = _p99([o.seconds for o in baseline if o.index in clean])
    res.p99_ratio = res.p99_unfaulted_s / res.p99_baseline_s if res.p99_baseline_s else 0.0


def _targets(res: SoakResult, args: argparse.Namespace) -> None:
    checks = [
        (not res.unexpected_5xx, f"{len(res.unexpected_5xx)} unexpected 5xx / error events"),
        (res.hangs == 0, f"{res.hangs} requests hung past --request-timeout"),
        (res.leaked_blocks == 0, f"{res.leaked_blocks} KV blocks leaked"),
        (res.integrity_ok, "check_integrity failed"),
        (res.rss_growth_mib < 50, f"RSS grew {res.rss_growth_mib:.1f} MiB (target < 50)"),
        (res.p99_ratio <= 1.5, f"p99 of unfaulted requests {res.p99_ratio:.2f}x the baseline"),
    ]
    if res.drain_seconds is not None:
        # NOTE: the server exits by its deadline (it cuts requests a reserve before it); the
        # margin covers only the signal's delivery and the OS reaping the process.
        limit = args.shutdown_timeout + 0.25
        checks.append((res.drain_exit_code == 0, f"drain exit code {res.drain_exit_code}"))
        checks.append((res.drain_seconds <= limit, f"drain took {res.drain_seconds:.1f} s"))
        checks.append((res.drain_stream_ended_with_error, "drained stream had no error event"))
    res.failures = [msg for ok, msg in checks if not ok]


def build_parser() -> argparse.ArgumentParser:
    """The soak's own options (``kvserve bench soak --help``)."""
    p = argparse.ArgumentParser(
        prog="kvserve bench soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--num-requests", type=int, default=2000, help="requests per pass")
    p.add_argument("--warmup", type=int, default=50, help="warm-up requests before the RSS")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument(
        "--fault-fraction",
        type=float,
        default=0.05,
        help="share of requests with an injected fault (half) or fuzzed parameters",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0, help="a hang, past this")
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    p.add_argument(
        "--drain-tokens",
        type=int,
        default=4000,
        help="length of the stream in flight at SIGTERM (0: no drain test)",
    )
    p.add_argument(
        "--huge-prompt-bytes",
        type=int,
        default=3 << 20,
        help="size of the prompt sent beside small requests (0: skip; the server's "
        "--max-request-bytes must allow it)",
    )
    p.add_argument("--url", default=None, help="use a running server (no RSS, no drain test)")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra `kvserve serve` argument (repeatable), e.g. --server-arg=--max-num-seqs=32",
    )
    p.add_argument("--out", default=None, help="also write the JSON record here")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvserve bench soak``."""
    args = build_parser().parse_args(argv)
    if not 0 <= args.fault_fraction <= 1 or args.num_requests < 1 or args.concurrency < 1:
        raise ValueError("--fault-fraction must be in [0, 1]; counts must be >= 1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    res = run(args)
    record = json.dumps(asdict(res), indent=2)
    print(record)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(record + "\n")
    for msg in res.failures:
        print(f"[soak] MISSED: {msg}", file=sys.stderr)
    return 1 if res.failures else 0


if __name__ == "__main__":
    sys.exit(main())
