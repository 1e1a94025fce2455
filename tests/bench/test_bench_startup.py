"""``kvserve bench startup``: one run on a tiny model; the report's fields, not its timings."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvserve import cli
from tests.tiny_models import make_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_bench_startup_reports_medians_and_the_ratio(tmp_path, capsys, monkeypatch) -> None:
    model_dir = make_tiny_model(tmp_path, "llama")
    # NOTE: the timed processes run this checkout's kvserve.
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    )
    out = tmp_path / "startup.json"
    argv = [
        "bench", "startup", "--runs", "1", "--warmup", "0", "--model", str(model_dir),
        "--num-kv-blocks", "64", "--max-model-len", "128", "--num-threads", "1",
        "--output-json", str(out),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "import torch:" in text and "ratio:" in text and "target <= 4x" in text
    record = json.loads(out.read_text())
    assert record["benchmark"] == "startup"
    r = record["results"]
    assert r["runs"] == 1 and r["warmup_s"] == []
    assert len(r["import_torch_runs_s"]) == len(r["generate_runs_s"]) == 1
    assert r["import_torch_s"] > 0 and r["generate_first_token_s"] > 0
    assert r["ratio"] == pytest.approx(r["generate_first_token_s"] / r["import_torch_s"])
    assert r["within_target"] == (r["ratio"] <= r["target_ratio"] == 4.0)
    assert r["engine_ready_s"] is not None  # read from the generate's start-up line
    gen = r["generate_command"]
    assert gen[:6] == ["-m", "kvserve.cli", "generate", "Hi", "--max-tokens", "1"]
    assert gen[gen.index("--model") + 1] == str(model_dir)
    assert gen[gen.index("--num-kv-blocks") + 1] == "64"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--runs", "0"], "--runs must be >= 1, got 0"),
        (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    ],
)
def test_bench_startup_refuses_bad_counts(capsys, flags, message) -> None:
    assert cli.main(["bench", "startup", *flags]) == 2
    assert f"kvserve: error: {message}" in capsys.readouterr().err
