"""A script that builds a TP engine at top level, without the ``__main__`` guard: the spawned
worker re-imports it and exits, and the driver fails at once naming the fix (it used to
wait out the 600 s rendezvous: "1/3 clients joined")."""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.distributed.sharding import OVERSUBSCRIBE_ENV
from kvserve.distributed.spawn_check import (
    UNGUARDED_MAIN_EXIT,
    importing_main_in_spawned_process,
    wait_workers_started,
)
from tests.tiny_models import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
GUARD = 'under `if __name__ == "__main__":`'


def test_not_importing_main_here() -> None:
    assert not importing_main_in_spawned_process()


@pytest.mark.parametrize(
    ("code", "message"),
    [(3, "worker w exited with code 3 before it started"), (UNGUARDED_MAIN_EXIT, GUARD)],
)
def test_worker_exit_before_start_raises_at_once(code: int, message: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=os._exit, args=(code,), name="w")  # never signals
    proc.start()
    writer.close()
    with pytest.raises(RuntimeError, match=re.escape(message)):
        wait_workers_started([proc], [reader], timeout_s=300)


def test_unguarded_script_fails_at_once_naming_the_guard(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path, "llama", num_hidden_layers=1)
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from kvserve.engine.llm import LLM\n"
        f"llm = LLM(model={str(model)!r}, tensor_parallel_size=2, num_threads=1,\n"
        "          num_kv_blocks=16, kernel_selection='off')\n"
        "print('built')\n"
    )
    env = {**os.environ, OVERSUBSCRIBE_ENV: "1", "PYTHONPATH": str(REPO)}
    # NOTE: the bound only keeps a regression from hanging the suite for the 600 s rendezvous.
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert "built" not in run.stdout
    # the driver's error (the script's traceback) and the worker's own line both name the fix
    assert "RuntimeError: tensor-parallel workers are spawned" in run.stderr, run.stderr
    assert run.stderr.count(GUARD) == 2, run.stderr
    assert str(script) in run.stderr
