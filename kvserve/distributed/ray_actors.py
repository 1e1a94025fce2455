"""What every kvserve Ray actor (a tensor-parallel rank, a data-parallel replica) starts with."""

from __future__ import annotations

import os

# Passed on from the driver: the checkout the actors import, and OpenMP's wait policy.
INHERITED = ("PYTHONPATH", "OMP_WAIT_POLICY")


def actor_env() -> dict[str, str]:
    """The ``runtime_env`` env vars of a kvserve actor.

    NOTE: ``RAY_worker_niceness=0``: Ray starts its workers at niceness 15 (so that its own
    daemons stay responsive), and an actor that serves requests then loses the CPU to any
    ordinary process on the host. Beside two busy loops on the 2-vCPU Zen 4 EPYC, the Ray
    router test's replicas made no progress until the loops ended (45 s beside 40 s loops,
    103 s beside 100 s ones; 11-15 s alone); at niceness 0 it took 28 s beside 60 s loops
    (2026-12-08). Ray's job manager sets the same for its job supervisor.
    """
    env = {k: os.environ[k] for k in INHERITED if k in os.environ}
    env["RAY_worker_niceness"] = "0"
    return env
