"""``kvserve serve --data-parallel-size N``: N engine replicas behind the router.

Replicas are ``kvserve serve`` processes on loopback ports (``--distributed-executor-backend
mp``, the default), or Ray actors that each run an engine and its server on their node
(``ray``; joins the cluster at ``RAY_ADDRESS`` or starts a local one). The router then serves
the one OpenAI endpoint on ``--host``/``--port``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from kvserve.distributed.ray_actors import actor_env
from kvserve.engine.config import EngineConfig
from kvserve.router.replicas import api_headers
from kvserve.server.limits import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_KEEP_ALIVE_TIMEOUT_S

logger = logging.getLogger("kvserve.router")

STARTUP_TIMEOUT_S = 600.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def engine_flags(config: EngineConfig) -> list[str]:
    """The command-line flags that rebuild ``config`` (only fields off their default)."""
    out: list[str] = []
    for f in dataclasses.fields(EngineConfig):
        value = getattr(config, f.name)
        if value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + f.name.replace("_", "-"))
        elif value is not None:
            out += [flag, str(value)]
    return out


def replica_config(config: EngineConfig, num_replicas: int) -> EngineConfig:
    """Each replica's config: the cores split between replicas unless --num-threads is set."""
    if config.num_threads is not None:
        return config
    return config.replace(num_threads=max(1, (os.cpu_count() or 1) // num_replicas))


def server_flags(args: argparse.Namespace) -> list[str]:
    """The replica-side server flags passed through from ``serve``: every flag of the
    ``server`` group that shapes what a replica answers (``--allowed-origins`` is the
    router's, in front)."""
    out = ["--quiet", "--log-level", args.log_level]
    for name, value in (replica_server_kwargs(args) | replica_http_timeouts(args)).items():
        flag = "--" + _FLAG_OF_KWARG.get(name, name).replace("_", "-")
        if isinstance(value, bool):
            out += [flag] if value else []
        elif value is not None:
            out += [flag, str(value)]
    if args.debug_inject_faults:
        out.append("--debug-inject-faults")
    return out


def replica_server_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``serve`` options each replica's server takes (``build_app``'s keywords; a chat
    template as given, a file path or the template text)."""
    return {
        "api_key": args.api_key,
        "max_queued_requests": args.max_queued_requests,
        "served_model_name": args.served_model_name,
        "max_request_bytes": args.max_request_bytes,
        "shutdown_timeout": args.shutdown_timeout,
        "protect_metrics": args.protect_metrics,
        "debug_endpoints": args.debug_endpoints,
        "chat_template": args.chat_template,
        "tool_call_parser": args.tool_call_parser,
        "open_tokenize_endpoints": args.open_tokenize_endpoints,
        "body_timeout": args.timeout_body_read,
    }


# NOTE: the build_app keywords whose serve flag has another name.
_FLAG_OF_KWARG = {"body_timeout": "timeout_body_read"}


def replica_http_timeouts(args: argparse.Namespace) -> dict[str, float]:
    """The header-read and keep-alive timeouts each replica's HTTP server takes (the same as
    the router's: a client that reaches a replica directly meets the same limits)."""
    return {
        "timeout_header_read": args.timeout_header_read,
        "timeout_keep_alive": args.timeout_keep_alive,
    }


def wait_healthy(
    urls: list[str],
    procs: list[subprocess.Popen] | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    """Block until every URL answers /health 200 (RuntimeError if a process exits first).
    ``headers``: the replicas' API key, for servers whose key guards /health too."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    pending = list(urls)
    while pending:
        for i, p in enumerate(procs or []):
            if p.poll() is not None:
                raise RuntimeError(f"replica {urls[i]} exited with {p.returncode} at start-up")
        still = []
        for url in pending:
            try:
                if httpx.get(url + "/health", timeout=2.0, headers=headers).status_code == 200:
                    continue
            except httpx.TransportError:
                pass
            still.append(url)
        pending = still
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"replicas not healthy after {STARTUP_TIMEOUT_S} s: {pending}")
        if pending:
            time.sleep(0.5)


@contextmanager
def local_replicas(
    config: EngineConfig,
    num_replicas: int,
    extra_flags: list[str],
    *,
    log_dir: str | None = None,
    headers: dict[str, str] | None = None,
) -> Iterator[list[str]]:
    """Run ``num_replicas`` ``kvserve serve`` processes; yields their URLs; stops them on exit.

    A replica that exits while they serve is started again on its port (``_supervise``): the
    router's probes take it out of the pool and bring it back once it answers.
    """
    flags = engine_flags(replica_config(config, num_replicas))
    procs: list[subprocess.Popen] = []
    cmds: list[list[str]] = []
    urls: list[str] = []
    logs = []
    stop = threading.Event()
    supervisor: threading.Thread | None = None
    try:
        for i in range(num_replicas):
            port = free_port()
            cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port)]
            cmd += flags + extra_flags
            log = (
                open(os.path.join(log_dir, f"replica-{i}.log"), "w")  # noqa: SIM115
                if log_dir
                else None
            )
            logs.append(log)
            cmds.append(cmd)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=log, preexec_fn=_die_with_parent))
            urls.append(f"http://127.0.0.1:{port}")
        wait_healthy(urls, procs, headers)
        supervisor = threading.Thread(
            target=_supervise, args=(procs, cmds, logs, stop), daemon=True, name="kvserve-replicas"
        )
        supervisor.start()
        yield urls
    finally:
        stop.set()
        if supervisor is not None:
            supervisor.join(timeout=10)  # NOTE: before the clean-up reads procs
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in logs:
            if log is not None:
                log.close()


def _supervise(
    procs: list[subprocess.Popen],
    cmds: list[list[str]],
    logs: list[Any],
    stop: threading.Event,
    max_backoff_s: float = 60.0,
) -> None:
    """Start a replica that exited again with its command (its port), until ``stop``.

    NOTE: a replica that keeps dying waits twice as long before each start (1 s up to
    ``max_backoff_s``), so a crash loop does not spin; ``procs`` is updated in place, so the
    caller's clean-up stops the new processes.
    """
    backoff = [1.0] * len(procs)
    next_start = [0.0] * len(procs)
    while not stop.wait(0.5):
        for i, p in enumerate(procs):
            if p.poll() is None or time.monotonic() < next_start[i]:
                continue
            logger.warning(
                "replica %d exited with %s; starting it again on port %s",
                i,
                p.returncode,
                cmds[i][5],
            )
            procs[i] = subprocess.Popen(
                cmds[i], stdout=logs[i], stderr=logs[i], preexec_fn=_die_with_parent
            )
            next_start[i] = time.monotonic() + backoff[i]
            backoff[i] = min(2 * backoff[i], max_backoff_s)


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the parent dies (Linux), so that a killed
    ``serve --data-parallel-size`` never leaves replicas behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit, so that ``finally`` blocks stop the replicas; a SIGTERM
    after that is logged and ignored, so that it cannot cut their clean-up short.

    NOTE: uvicorn re-raises the signal that stopped it once it has shut down; with the
    default handler that kills the process before any clean-up runs. A second SIGTERM (a
    supervisor that signals the process group, or an impatient ``kill``) raised SystemExit
    again inside the clean-up, cutting it short before the later replicas were terminated.
    A handler, not SIG_IGN: a replica started meanwhile would inherit SIG_IGN through exec.
    """
    if threading.current_thread() is not threading.main_thread():
        return

    def stopping(*_: object) -> None:
        logger.warning("SIGTERM again: already stopping the replicas")

    def stop(*_: object) -> None:
        signal.signal(signal.SIGTERM, stopping)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)


class ReplicaServer:
    """One engine and its OpenAI server in this process (the body of a Ray replica actor)."""

    def __init__(
        self,
        config: EngineConfig,
        server_kwargs: dict[str, Any],
        http_timeouts: dict[str, float] | None = None,
    ) -> None:
        import uvicorn

        from kvserve.engine.async_engine import build_on_engine_thread
        from kvserve.engine.llm_engine import LLMEngine
        from kvserve.server.app import build_app
        from kvserve.server.http_timeouts import uvicorn_config

        engine, executor = build_on_engine_thread(lambda: LLMEngine(config))
        app = build_app(engine, executor=executor, **server_kwargs)
        host = _node_ip()
        port = free_port(host)
        self.url = f"http://{host}:{port}"
        timeouts = http_timeouts or {}
        http_config = uvicorn_config(
            app,
            host=host,
            port=port,
            header_timeout=timeouts.get("timeout_header_read", DEFAULT_HEADER_TIMEOUT_S),
            keep_alive_timeout=timeouts.get("timeout_keep_alive", DEFAULT_KEEP_ALIVE_TIMEOUT_S),
        )
        self.server = uvicorn.Server(http_config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the replica server on {self.url} did not start")
            time.sleep(0.05)

    def get_url(self) -> str:
        """The server's base URL."""
        return self.url

    def pid(self) -> int:
        """The actor's process id."""
        return os.getpid()


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    return "127.0.0.1"


def ray_replicas(
    config: EngineConfig,
    num_replicas: int,
    server_kwargs: dict[str, Any],
    http_timeouts: dict[str, float] | None = None,
) -> tuple[list[Any], list[str]]:
    """Start ``num_replicas`` Ray actors (one CPU each unless --num-threads says more).

    Joins the running Ray cluster (``ray.init()`` called before, or ``RAY_ADDRESS``), else
    starts a local one. Returns the actor handles and their server URLs.
    """
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
    threads = config.num_threads or 1
    cfg = config.replace(num_threads=threads)
    actor_cls = ray.remote(num_cpus=threads, runtime_env={"env_vars": actor_env()})(ReplicaServer)
    actors = [actor_cls.remote(cfg, server_kwargs, http_timeouts) for _ in range(num_replicas)]
    urls = ray.get([a.get_url.remote() for a in actors], timeout=STARTUP_TIMEOUT_S)
    return actors, list(urls)


def serve_data_parallel(args: argparse.Namespace) -> int:
    """Start the replicas, then serve the router on ``--host``/``--port`` until interrupted."""
    import uvicorn

    from kvserve.router.cli import build_validated_app
    from kvserve.server.http_timeouts import uvicorn_config_from_args

    config = EngineConfig.from_cli_args(args)
    n = args.data_parallel_size
    exit_on_sigterm()
    backend = getattr(args, "distributed_executor_backend", "mp")

    def run(urls: list[str]) -> int:
        app = build_validated_app(urls, args)
        print(
            f"[kvserve] {n} replicas ({backend}) behind the {args.routing} router on "
            f"http://{args.host}:{args.port}: {', '.join(urls)}",
            file=sys.stderr,
            flush=True,
        )
        # NOTE: the router is the front door: the header-read and keep-alive timeouts apply
        # there (the replicas behind it get whole requests from it).
        http_config = uvicorn_config_from_args(app, args)
        server = uvicorn.Server(http_config)
        with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run
            server.run()
        return 0 if server.started else 3  # uvicorn.run's exit code for a failed start

    if backend == "ray":
        from kvserve.server.chat_template import load_chat_template

        kwargs = replica_server_kwargs(args)
        kwargs["chat_template"] = load_chat_template(args.chat_template)
        actors, urls = ray_replicas(config, n, kwargs, replica_http_timeouts(args))
        try:
            return run(urls)
        finally:
            import ray

            for a in actors:
                ray.kill(a)
    with local_replicas(config, n, server_flags(args), headers=api_headers(args.api_key)) as urls:
        return run(urls)
