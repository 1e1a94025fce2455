"""``kvserve chat`` on a tiny model: streams a reply step by step, marks a reply cut by
--max-tokens, and quits on /exit and /quit without sending them to the model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.cli import stream_chat_reply
from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


class _Recorder:
    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> None:
        self.writes.append(text)

    def flush(self) -> None:
        pass


def test_reply_streams_and_marks_the_cut(model_dir: Path) -> None:
    llm = LLM(model=str(model_dir), num_kv_blocks=64, max_model_len=128, num_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = _Recorder()
    reply = stream_chat_reply(llm, [{"role": "user", "content": "hi"}], params, out)
    text_writes = out.writes[:-2]  # then "\n" and the marker
    assert len(text_writes) >= 2  # more than one piece: written as the tokens came
    assert "".join(text_writes) == reply
    assert out.writes[-1] == "[reply cut at --max-tokens 8]\n"
    assert llm.stats()["num_running"] == 0


@pytest.mark.parametrize("command", ["/exit", "/quit"])
def test_chat_command_quits_on_exit_commands(model_dir: Path, command: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "chat", "--model", str(model_dir), "--quiet",
         "--num-kv-blocks", "64", "--max-model-len", "128", "--num-threads", "1",
         "--max-tokens", "4", "--ignore-eos"],
        input=f"hello\n{command}\nnever sent\n",
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("[reply cut at --max-tokens 4]") == 1  # /exit got no reply
    assert proc.stdout.count("> ") == 2
