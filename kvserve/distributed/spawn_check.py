"""Spawned workers and the main module: a script without the ``__main__`` guard fails at once.

The ``mp`` backend spawns ranks 1..N-1; a spawned process first re-imports the parent's
main module (as ``__mp_main__``). A script that builds a TP engine at top level then builds
it again in every worker, whose own spawn fails (Python's "bootstrapping phase" error), and
the driver used to wait out the 600 s rendezvous ("1/3 clients joined").

Now the worker sees that it is still importing the main module when an engine with
``tensor_parallel_size > 1`` is built (``refuse_tp_engine_while_importing_main``, called by
``LLMEngine``), prints why and exits with ``UNGUARDED_MAIN_EXIT``; the driver waits for each
worker's start-up signal or its exit (``wait_workers_started``) and raises a RuntimeError
naming the fix. vLLM documents the same fix for its spawned workers ("Python
multiprocessing", troubleshooting).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import sys
import time
from typing import Any

UNGUARDED_MAIN_EXIT = 86  # a worker's exit code: it re-imported an unguarded main module


def _main_path() -> str:
    # NOTE: while a spawned child re-imports the script, runpy holds it as ``__mp_main__``
    # (``__main__`` is still the bootstrap's, without a file).
    for name in ("__mp_main__", "__main__"):
        if path := getattr(sys.modules.get(name), "__file__", None):
            return str(path)
    return "the main module"


def unguarded_main_message(path: str | None = None) -> str:
    """What to do when the main module builds a TP engine outside the ``__main__`` guard."""
    where = path or _main_path()
    return (
        "tensor-parallel workers are spawned processes that import the main module "
        f"({where}), and it builds the LLM at import time: put the code that builds the LLM "
        'under `if __name__ == "__main__":` (see docs/distributed.md)'
    )


def importing_main_in_spawned_process() -> bool:
    """Whether this process is a spawned child still re-importing its parent's main module.

    NOTE: ``_inheriting`` is set by ``multiprocessing.spawn`` around that import (the same
    flag Python's own "bootstrapping phase" check reads); ``parent_process()`` is still None
    then and the process already carries the child's name, so neither tells.
    """
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def refuse_tp_engine_while_importing_main(tensor_parallel_size: int) -> None:
    """In a spawned child re-importing an unguarded main module that builds a TP engine:
    print why and exit with ``UNGUARDED_MAIN_EXIT`` (the driver names the fix)."""
    if tensor_parallel_size > 1 and importing_main_in_spawned_process():
        name = multiprocessing.current_process().name
        print(f"[kvserve] {name}: {unguarded_main_message()}", file=sys.stderr, flush=True)
        raise SystemExit(UNGUARDED_MAIN_EXIT)


def worker_exit_error(proc: Any) -> RuntimeError:
    """The driver's error for a worker that exited before it signalled its start."""
    if proc.exitcode == UNGUARDED_MAIN_EXIT:
        return RuntimeError(unguarded_main_message())
    return RuntimeError(
        f"tensor-parallel worker {proc.name} exited with code {proc.exitcode} before it "
        "started (its error is printed above)"
    )


def wait_workers_started(procs: list[Any], readers: list[Any], timeout_s: float) -> None:
    """Wait until every worker has sent its start-up signal on its pipe (``readers[i]`` for
    ``procs[i]``). RuntimeError at once where one exits first; TimeoutError after
    ``timeout_s``."""
    pending = dict(zip(readers, procs, strict=True))
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            names = ", ".join(p.name for p in pending.values())
            raise TimeoutError(
                f"tensor-parallel workers did not start in {timeout_s:.0f} s: {names}"
            )
        waitables = [*pending, *(p.sentinel for p in pending.values())]
        multiprocessing.connection.wait(waitables, timeout=left)
        for conn, proc in list(pending.items()):
            if conn.poll():
                try:
                    conn.recv()
                except EOFError:  # the worker exited: its end of the pipe closed
                    proc.join(5)
                    raise worker_exit_error(proc) from None
                del pending[conn]
                conn.close()
            elif proc.exitcode is not None:
                raise worker_exit_error(proc)
