"""The driver side of tensor parallelism: start the workers, be rank 0, broadcast each step.

``TensorParallelExecutor.start`` validates the size against the model (ValueError naming the
numbers), starts ranks 1..N-1 (torch.multiprocessing processes, or Ray actors with
``distributed_executor_backend="ray"``) and joins the group as rank 0 in this process.
The engine then builds rank 0's model (``build_model``), plans its memory as usual (per rank:
the rank's weights and KV heads), builds rank 0's ModelRunner and calls ``start_runners``:
every worker builds its runner with the same block count and reports back. ``execute``
broadcasts the SchedulerOutput and runs rank 0's step; rank 0 samples.

A worker that dies or hangs makes the collectives fail or time out
(``$KVSERVE_TP_TIMEOUT_S``): ``execute`` raises TPCollectiveError, the engine loop dies with
it (in-flight requests fail with that error, ``/health`` answers 503) and nothing hangs.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import socket
from typing import Any

import torch

from kvserve.config import ModelArchConfig
from kvserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.distributed.comm import TPCollectiveError, TPGroup, tp_timeout_s
from kvserve.distributed.ray_actors import actor_env
from kvserve.distributed.sharding import ShardSpec, validate_tp
from kvserve.distributed.spawn_check import wait_workers_started
from kvserve.distributed.worker import (
    STARTUP_TIMEOUT_S,
    build_rank_model,
    model_bytes,
    mp_worker_main,
    rank_threads,
    runner_arch,
)
from kvserve.engine.config import EngineConfig
from kvserve.engine.memory_budget import MemoryReport

logger = logging.getLogger("kvserve.distributed")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass(frozen=True)
class TPMemoryReport(MemoryReport):
    """The driver's memory report plus one line per rank (the budget is per rank)."""

    rank_lines: tuple[str, ...] = ()

    def lines(self, typical_len: int = 512) -> list[str]:
        """The per-rank budget (rank 0's figures, every rank alike), then each rank's line."""
        return [
            f"tensor parallel: {len(self.rank_lines)} ranks; figures below are per rank",
            *super().lines(typical_len),
            *self.rank_lines,
        ]


class TensorParallelExecutor:
    """Rank 0 and the handles of the other ranks."""

    def __init__(self, config: EngineConfig, arch: ModelArchConfig, group: TPGroup) -> None:
        self.config = config
        self.arch = arch
        self.group = group
        self.spec = ShardSpec(arch, config.tensor_parallel_size, 0)
        self.procs: list[Any] = []
        self.actors: list[Any] = []
        self.runner: Any = None
        self.reports: list[dict[str, Any]] = []
        self.dead: BaseException | None = None

    @classmethod
    def start(cls, config: EngineConfig, arch: ModelArchConfig) -> TensorParallelExecutor:
        """Validate, start the workers, join as rank 0 (ValueError on a bad size)."""
        n = config.tensor_parallel_size
        validate_tp(arch, n, config.device)
        timeout = tp_timeout_s()
        torch.set_num_threads(rank_threads(config))
        procs: list[Any] = []
        actors: list[Any] = []
        if config.distributed_executor_backend == "ray":
            import ray

            if not ray.is_initialized():
                ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
            host = ray.util.get_node_ip_address()
            init_method = f"tcp://{host}:{_free_port()}"
            from kvserve.distributed.worker import RayTPWorker

            actor_cls = ray.remote(
                num_cpus=rank_threads(config), runtime_env={"env_vars": actor_env()}
            )(RayTPWorker)
            actors = [actor_cls.remote() for _ in range(1, n)]
            for rank, actor in enumerate(actors, start=1):
                actor.run.remote(rank, n, init_method, config, timeout)
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            ctx = torch.multiprocessing.get_context("spawn")
            readers = []
            for rank in range(1, n):
                reader, writer = ctx.Pipe(duplex=False)
                p = ctx.Process(
                    target=mp_worker_main,
                    args=(rank, n, init_method, config, timeout, writer),
                    daemon=True,
                    name=f"kvserve-tp-{rank}",
                )
                p.start()
                writer.close()  # NOTE: the worker's copy alone: its exit closes the pipe
                procs.append(p)
                readers.append(reader)
            try:
                # NOTE: a worker that dies while importing the main module (a script without
                # the __main__ guard) fails here at once, not after the 600 s rendezvous.
                wait_workers_started(procs, readers, STARTUP_TIMEOUT_S)
            except BaseException:
                _stop(procs, actors)
                raise
        try:
            group = TPGroup.init(0, n, init_method, config.device, STARTUP_TIMEOUT_S)
        except BaseException:
            _stop(procs, actors)
            raise
        ex = cls(config, arch, group)
        ex.procs, ex.actors = procs, actors
        atexit.register(ex.shutdown)
        return ex

    def build_model(self, state_dict: dict[str, Any]) -> torch.nn.Module:
        """Rank 0's model: its slices of ``state_dict``, in the config's dtype."""
        return build_rank_model(self.config, self.spec, self.group, state_dict)

    def runner_arch(self) -> ModelArchConfig:
        """Shapes for rank 0's ModelRunner (its KV heads, the full vocabulary)."""
        return runner_arch(self.spec)

    def start_runners(self, runner: Any, runner_kwargs: dict[str, Any]) -> None:
        """Send every worker its ModelRunner arguments; collect what each rank holds."""
        self.runner = runner
        torch.distributed.monitored_barrier(
            self.group.cpu_group,
            timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S),
            wait_all_ranks=True,
        )
        self.group.broadcast_object(runner_kwargs)
        reports = self.group.gather_objects(
            {
                "rank": 0,
                "pid": os.getpid(),
                "weights_bytes": model_bytes(runner.model),
                "kv_bytes_per_token": runner.kv_cache.bytes_per_token,
                "num_kv_blocks": runner.num_blocks,
                "num_kv_heads": self.spec.num_kv_heads,
                "kv_head_start": self.spec.kv_head_start,
                "num_heads": self.spec.num_heads,
            }
        )
        self.reports = list(reports or [])
        self.group.set_timeout(tp_timeout_s())

    def memory_report(self, rep: MemoryReport) -> TPMemoryReport:
        """``rep`` (rank 0's budget) with one line per rank."""
        lines = []
        for r in self.reports:
            kv = r["num_kv_blocks"] * rep.block_size * r["kv_bytes_per_token"]
            heads = f"query heads {r['num_heads']}, KV heads {r['num_kv_heads']}"
            heads += f" from {r['kv_head_start']}"
            lines.append(
                f"rank {r['rank']} (pid {r['pid']}): weights {r['weights_bytes'] / 2**20:.1f} "
                f"MiB, KV cache {kv / 2**20:.1f} MiB ({r['num_kv_blocks']} blocks x "
                f"{r['kv_bytes_per_token']} bytes/token), {heads}"
            )
        fields = {f.name: getattr(rep, f.name) for f in dataclasses.fields(MemoryReport)}
        return TPMemoryReport(**fields, rank_lines=tuple(lines))

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Broadcast ``sched``, run rank 0's step (its all-reduces wait for every rank)."""
        if self.dead is not None:
            raise TPCollectiveError(f"the tensor-parallel group is down: {self.dead}")
        try:
            self.group.broadcast_object(sched)
            return self.runner.execute(sched)
        except TPCollectiveError as e:
            self.dead = e
            dead = [p.name for p in self.procs if not p.is_alive()]
            detail = f" (exited: {', '.join(dead)})" if dead else ""
            raise TPCollectiveError(f"{e}{detail}; the engine is stopped") from e

    def shutdown(self) -> None:
        """Tell the workers to stop, then make sure they have (idempotent)."""
        if self.group is None:
            return
        if self.dead is None:
            try:
                self.group.broadcast_object(None)
            except TPCollectiveError:
                pass
        _stop(self.procs, self.actors)
        self.group.destroy()
        self.group = None  # type: ignore[assignment]


def _stop(procs: list[Any], actors: list[Any]) -> None:
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
    if actors:
        import ray

        for a in actors:
            ray.kill(a)


class TPRunner:
    """What the engine calls as its runner under tensor parallelism (ModelRunner's API)."""

    def __init__(self, executor: TensorParallelExecutor) -> None:
        self.executor = executor

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every rank."""
        return self.executor.execute(sched)

    def __getattr__(self, name: str) -> Any:
        # NOTE: everything else (kv_cache, model, workspace, ...) is rank 0's runner's.
        return getattr(self.executor.runner, name)
