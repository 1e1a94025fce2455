"""The README's examples run as written: its Python example, and its `curl` lines against a
server started with the README's own `kvserve serve` flags (embedded model)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.server.server_proc import REPO_ROOT, running_server

README = (REPO_ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else len(README)]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.DOTALL)


def _commands(block: str) -> list[str]:
    """Shell commands of a block, backslash continuations joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and line[0] != "#"]


def _serve_flags() -> list[str]:
    """The flags of the server section's `kvserve serve` line, without [optional] ones."""
    section = _section("OpenAI-compatible server")
    line = next(c for b in _blocks(section, "bash") for c in _commands(b) if " serve " in f"{c} ")
    words = shlex.split(line.split("[", 1)[0])
    flags = words[words.index("serve") + 1 :]
    if "--port" in flags:  # the test picks a free port
        i = flags.index("--port")
        del flags[i : i + 2]
    return flags


def test_curl_examples_run_as_written() -> None:
    curls = [
        c
        for b in _blocks(_section("OpenAI-compatible server"), "bash")
        for c in _commands(b)
        if c.startswith("curl ")
    ]
    assert len(curls) >= 3
    with running_server(*_serve_flags()) as url:
        port = url.rsplit(":", 1)[1]
        for command in curls:
            command = command.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
            proc = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, (command, proc.stderr)
            if " -sI " in f" {command} ":
                assert proc.stdout.startswith("HTTP/1.1 200"), proc.stdout
            else:
                body = json.loads(proc.stdout)
                assert "error" not in body, (command, body)


def test_python_example_runs_as_written() -> None:
    (code,) = _blocks(_section("Use it"), "python")[:1]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=Path(REPO_ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    hit_rate, utilization = map(float, proc.stdout.split()[-2:])  # its last print
    assert 0.0 <= hit_rate <= 1.0 and 0.0 <= utilization <= 1.0
