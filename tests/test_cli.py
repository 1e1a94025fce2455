"""The ``kvserve`` command line as a new user meets it: one start-up line by default, the
planner's detail with ``--log-level debug`` (on every sub-command), and only the run
sub-command's module imported."""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve import cli
from tests.tiny_models import make_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]
STARTUP_LINE = re.compile(
    r"^\[kvserve\] (?P<model>\S+) \| float32, dense kernels, (choice from cache|choice measured"
    r"|selection off) \| KV 1,024 tokens in 64 blocks, 8 requests at 128 tokens"
    r" \| ready in \d+\.\d s$"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """``cli.main`` configures logging for the process; put it back after each test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    names = ("kvserve", *cli.DETAIL_LOGGERS)
    levels = {name: logging.getLogger(name).level for name in names}
    yield
    root.handlers[:], root.level = handlers, level
    for name, old in levels.items():
        logging.getLogger(name).setLevel(old)


def _generate(model_dir: Path, *extra: str) -> list[str]:
    return [
        "generate", "hi", "--raw", "--model", str(model_dir), "--num-kv-blocks", "64",
        "--max-model-len", "128", "--num-threads", "1", "--max-tokens", "2", "--ignore-eos",
        "--dtype", "float32", "--temperature", "0", *extra,
    ]  # fmt: skip


def test_generate_prints_one_start_up_line_then_the_answer(model_dir: Path, capsys) -> None:
    assert cli.main(_generate(model_dir)) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err  # the start-up line, then the speed line
    assert STARTUP_LINE.match(err[0]), err[0]
    assert STARTUP_LINE.match(err[0])["model"] == Path(model_dir).name
    assert err[1].startswith("[kvserve] 2 tokens in ")


def test_generate_samples_by_default_and_prints_its_seed(model_dir: Path, capsys) -> None:
    """No --temperature: llama.cpp's sampling (the tiny model has no sampling defaults), the
    seed on one stderr line between the start-up and speed lines."""
    argv = _generate(model_dir)
    at = argv.index("--temperature")
    del argv[at : at + 2]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3, err
    assert STARTUP_LINE.match(err[0]), err[0]
    assert re.fullmatch(r"\[kvserve\] sampling seed \d+ \(--sampling-seed \d+ .*\)", err[1])
    assert err[2].startswith("[kvserve] 2 tokens in ")


def test_log_level_debug_shows_the_planner_detail(model_dir: Path, capsys) -> None:
    assert cli.main(_generate(model_dir, "--log-level", "debug")) == 0
    err = capsys.readouterr().err
    for detail in ("KV cache: ", "weights: ", "activations (largest step)", "headroom: "):
        assert f"[kvserve] {detail}" in err
    assert sum(bool(STARTUP_LINE.match(line)) for line in err.splitlines()) == 1


def test_quiet_and_warning_print_no_start_up_line(model_dir: Path, capsys) -> None:
    assert cli.main(_generate(model_dir, "--quiet")) == 0
    assert capsys.readouterr().err.startswith("[kvserve] 2 tokens in ")


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its sub-commands here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, child in action.choices.items():
                yield name, child
                for sub_name, grandchild in _subparsers(child):
                    yield f"{name} {sub_name}", grandchild


def test_every_sub_command_takes_log_level() -> None:
    parser = cli.build_parser()
    names = []
    for name, child in _subparsers(parser):
        if "-" not in child.prefix_chars:  # bench's pass-through commands: their own argv
            continue
        names.append(name)
        assert "--log-level" in child.format_help(), name
    assert {"generate", "chat", "serve", "simulate", "bench", "bench throughput"} <= set(names)
    args = parser.parse_args(["simulate", "--log-level", "DEBUG"])
    assert args.log_level == "debug"
    assert parser.parse_args(["--log-level", "warning", "simulate"]).log_level == "warning"
    assert parser.parse_args(["simulate"]).log_level == "info"
    assert parser.parse_args(["-v", "simulate"]).log_level == "debug"


def test_a_bad_log_level_is_refused_with_the_choices(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hi", "--log-level", "loud"])
    assert e.value.code == 2
    assert "--log-level: invalid choice: 'loud'" in capsys.readouterr().err


def test_serve_splits_kvserve_and_uvicorn_log_levels() -> None:
    args = cli.build_parser("serve").parse_args(["serve", "--log-level", "debug"])
    assert (args.log_level, args.uvicorn_log_level) == ("debug", "warning")


def test_command_of_skips_top_level_options() -> None:
    assert cli.command_of(["--log-level", "debug", "generate", "hi"]) == "generate"
    assert cli.command_of(["-v", "bench", "throughput"]) == "bench"
    assert cli.command_of(["--help"]) is None


def test_generate_imports_no_server_bench_or_plotting_module() -> None:
    """Building the parser for ``generate`` imports neither fastapi nor matplotlib nor the
    bench, simulate and router commands (seconds of a warm start); the help lists them all."""
    code = (
        "import sys\n"
        "from kvserve import cli\n"
        "cli.build_parser('generate')\n"
        "heavy = ('fastapi', 'matplotlib', 'kvserve.bench.cli', 'kvserve.sim.cli', "
        "'kvserve.router.cli', 'kvserve.server.cli')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "print(sorted(cli.build_parser()._subparsers._group_actions[0].choices))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True
    ).stdout.splitlines()
    assert out[0] == "[]"
    for name in ("generate", "chat", "serve", "bench", "simulate", "router"):
        assert f"'{name}'" in out[1]
