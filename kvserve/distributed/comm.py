"""The tensor-parallel process group: torch.distributed (gloo on CPU, NCCL on CUDA).

Two groups over the same ranks: the device group carries the all-reduces and the logits
gather; a gloo group on CPU carries the driver's per-step broadcast of the SchedulerOutput
(``broadcast_object_list``), as vLLM keeps a CPU group beside its NCCL one. Every collective
has the group's timeout: a dead or hung rank makes the others raise instead of waiting forever.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kvserve.engine.step_guard import StepFault

TIMEOUT_ENV = "KVSERVE_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0


class TPCollectiveError(StepFault):
    """A collective failed or timed out: a rank died or hung; the engine cannot continue.

    NOTE: a ``StepFault``: no request is to blame, so the step guard does not re-run the step
    in halves over a broken group; the engine stops (the server exits non-zero)."""


def tp_timeout_s() -> float:
    """Seconds a collective may wait (``$KVSERVE_TP_TIMEOUT_S``, default 60)."""
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group, and the collectives it runs."""

    rank: int
    world_size: int
    device: torch.device
    cpu_group: Any
    device_group: Any
    all_reduce_seconds: float = 0.0  # time in all-reduces and the logits gather (profiling)
    num_all_reduces: int = 0

    @classmethod
    def init(
        cls, rank: int, world_size: int, init_method: str, device: str, timeout_s: float
    ) -> TPGroup:
        """Join the group (blocks until every rank has joined or ``timeout_s`` passes)."""
        dev = torch.device(device)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
        )
        device_group = dist.group.WORLD
        cpu_group = (
            dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else device_group
        )
        return cls(rank, world_size, dev, cpu_group, device_group)

    def set_timeout(self, timeout_s: float) -> None:
        """Bound every later collective by ``timeout_s`` (after the long start-up phase).

        NOTE: the group is created with the start-up timeout (ranks load their shards at
        different speeds); the steps then run under the short one. ``_set_pg_timeout`` is
        torch's own (private) setter for a live group's gloo/NCCL backends.
        """
        from torch.distributed.distributed_c10d import _set_pg_timeout

        td = datetime.timedelta(seconds=timeout_s)
        for g in {
            id(self.device_group): self.device_group,
            id(self.cpu_group): self.cpu_group,
        }.values():
            _set_pg_timeout(td, g)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks in place; returns it."""
        t0 = time.perf_counter()
        try:
            dist.all_reduce(t, group=self.device_group)
        except RuntimeError as e:
            raise TPCollectiveError(f"tensor-parallel all-reduce failed: {e}") from e
        self.all_reduce_seconds += time.perf_counter() - t0
        self.num_all_reduces += 1
        return t

    def gather_to_first(self, t: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's ``t`` concatenated on the last dim; others get None."""
        t0 = time.perf_counter()
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == 0 else None
        try:
            dist.gather(t, parts, dst=0, group=self.device_group)
        except RuntimeError as e:
            raise TPCollectiveError(f"tensor-parallel logits gather failed: {e}") from e
        self.all_reduce_seconds += time.perf_counter() - t0
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 sends ``obj``; every rank returns it."""
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        except RuntimeError as e:
            raise TPCollectiveError(f"tensor-parallel broadcast failed: {e}") from e
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Rank 0 gets every rank's ``obj`` (in rank order); others get None."""
        out = [None] * self.world_size if self.rank == 0 else None
        try:
            dist.gather_object(obj, out, dst=0, group=self.cpu_group)
        except RuntimeError as e:
            raise TPCollectiveError(f"tensor-parallel gather failed: {e}") from e
        return out

    def destroy(self) -> None:
        """Leave the group (best effort)."""
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group cannot be torn down cleanly
                pass
