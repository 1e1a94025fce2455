"""A tensor-parallel worker (rank >= 1): its shard, its KV blocks, the driver's steps.

The driver (rank 0, in the engine's process) keeps the one scheduler and KV cache manager.
Each step it broadcasts the ``SchedulerOutput``; every worker runs the same step on its shard
(its heads' K/V in its own blocks; block ids are the same on every rank) and takes part in
the all-reduces; only rank 0 samples. ``None`` ends the loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any

import torch

from kvserve.core.outputs import LogprobsEntry, ScheduledRequest
from kvserve.distributed.comm import TPCollectiveError, TPGroup
from kvserve.distributed.sharding import ShardSpec
from kvserve.engine.config import EngineConfig

logger = logging.getLogger("kvserve.distributed")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

STARTUP_TIMEOUT_S = 600.0  # loading a shard may take minutes on a busy machine


def rank_threads(config: EngineConfig) -> int:
    """Torch threads per rank: ``num_threads`` if set, else the cores split over the ranks."""
    if config.num_threads is not None:
        return config.num_threads
    return max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


class NoSampler:
    """Stands in for the Sampler on ranks >= 1: rank 0 alone samples."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size  # read by the sampling guard (runtime/guard.py)

    def sample(
        self, logits: torch.Tensor, reqs: list[ScheduledRequest], token_bitmask: object = None
    ) -> tuple[list[int], list[LogprobsEntry | None]]:
        """Placeholders, never read (the driver uses rank 0's tokens)."""
        return [0] * len(reqs), [None] * len(reqs)

    def sample_greedy_checked(
        self, logits: torch.Tensor, reqs: list[ScheduledRequest], token_bitmask: object = None
    ) -> tuple[list[int], list[LogprobsEntry | None], list[int]]:
        """The guard's fast path (``Sampler.sample_greedy_checked``): placeholders, no bad row.

        NOTE: without it the sampling guard caught an AttributeError on every step of every
        worker and logged "the greedy fast path raised" each time. ``logits`` is [N, 0] here
        (rank 0 alone gathers the vocabulary): there is nothing to check.
        """
        return [0] * len(reqs), [None] * len(reqs), []


def build_rank_model(
    config: EngineConfig, spec: ShardSpec, group: TPGroup, state_dict: dict[str, Any]
) -> torch.nn.Module:
    """This rank's ``TPLlamaForCausalLM``, loaded with its slices, in the config's dtype."""
    from kvserve.distributed.tp_model import TPLlamaForCausalLM
    from kvserve.runtime.autotune import TuneSettings, choose_kernels

    model = TPLlamaForCausalLM(spec, group, max_model_len=config.max_model_len)
    model.load_sharded(state_dict)
    model = model.to(device=config.device, dtype=_DTYPES[config.dtype]).eval()
    # NOTE: the projection kernels are chosen for this rank's own weight shapes (measured at
    # start-up or read from the cache), not the full model's that the engine selected for.
    settings = TuneSettings(
        config.dtype, config.device, config.kernel_selection, config.batch_invariant
    )
    model.rank_linear_plan = choose_kernels(settings, spec.local_arch()).plan
    model.set_linear_plan(None)
    return model


def runner_arch(spec: ShardSpec):  # noqa: ANN201 - ModelArchConfig
    """The shapes the rank's ModelRunner needs: its KV heads, the full vocabulary."""
    return dataclasses.replace(spec.local_arch(), vocab_size=spec.arch.vocab_size)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )


def run_worker(
    rank: int, world_size: int, init_method: str, config: EngineConfig, timeout_s: float
) -> int:
    """The worker's whole life: join, load the shard, build the runner, run steps."""
    from kvserve.models.loader import load_model
    from kvserve.runtime.model_runner import ModelRunner

    torch.set_num_threads(rank_threads(config))
    torch.manual_seed(config.seed)
    group = TPGroup.init(rank, world_size, init_method, config.device, STARTUP_TIMEOUT_S)
    try:
        loaded = load_model(config.model, dtype=_DTYPES[config.dtype])
        spec = ShardSpec(loaded.arch, world_size, rank)
        model = build_rank_model(config, spec, group, loaded.state_dict)
        del loaded
        torch.distributed.monitored_barrier(
            group.cpu_group, timeout=_td(STARTUP_TIMEOUT_S), wait_all_ranks=True
        )
        kwargs = group.broadcast_object()  # the driver's ModelRunner arguments
        runner = ModelRunner(model, runner_arch(spec), **kwargs)
        runner.sampler = NoSampler(runner.sampler.vocab_size)  # type: ignore[assignment]
        group.gather_objects(
            {
                "rank": rank,
                "pid": os.getpid(),
                "weights_bytes": model_bytes(model),
                "kv_bytes_per_token": runner.kv_cache.bytes_per_token,
                "num_kv_blocks": runner.num_blocks,
                "num_kv_heads": spec.num_kv_heads,
                "kv_head_start": spec.kv_head_start,
                "num_heads": spec.num_heads,
            }
        )
        group.set_timeout(timeout_s)
        while True:
            sched = group.broadcast_object()
            if sched is None:
                return 0
            runner.execute(sched)
    except TPCollectiveError as e:
        print(f"[kvserve] tensor-parallel rank {rank}: {e}; exiting", file=sys.stderr)
        return 1
    finally:
        group.destroy()


def _td(seconds: float):  # noqa: ANN202 - datetime.timedelta
    import datetime

    return datetime.timedelta(seconds=seconds)


def mp_worker_main(
    rank: int,
    world_size: int,
    init_method: str,
    config: EngineConfig,
    timeout_s: float,
    started: Any = None,
) -> None:
    """torch.multiprocessing entry point (dies with the driver: SIGTERM on parent exit).

    ``started``: the pipe end on which it tells the driver that it got past importing the
    main module (``spawn_check.wait_workers_started``)."""
    if started is not None:
        started.send(rank)
        started.close()
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    sys.exit(run_worker(rank, world_size, init_method, config, timeout_s))


class RayTPWorker:
    """The Ray actor body of one worker: ``run`` blocks in the step loop."""

    def node_ip(self) -> str:
        """This actor's node address."""
        import ray

        return str(ray.util.get_node_ip_address())

    def pid(self) -> int:
        """The actor's process id."""
        return os.getpid()

    def run(
        self, rank: int, world_size: int, init_method: str, config: EngineConfig, timeout_s: float
    ) -> int:
        """``run_worker`` in this actor."""
        return run_worker(rank, world_size, init_method, config, timeout_s)
