"""``kvserve serve --config FILE.yaml`` (vLLM's convention): flag names with dashes or
underscores, command-line flags over the file's, a clear error on a key that is no flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvserve import cli


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = cli.build_parser("serve")
    return parser.parse_args(cli.expand_config_file(parser, argv))


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return str(path)


def test_config_file_sets_flags_and_the_command_line_overrides_them(tmp_path) -> None:
    path = _write(
        tmp_path,
        "max_num_seqs: 8\n"
        "max-model-len: 512\n"
        "port: 9001\n"
        "swap_space: 1GiB\n"
        "enable_prefix_caching: false\n"
        "debug_endpoints: true\n"
        "protect_metrics: false\n"
        "allowed_origins: [http://a.example, http://b.example]\n"
        "served_model_name: null\n",
    )
    args = _parse(["serve", "--config", path, "--port", "9002"])
    assert (args.max_num_seqs, args.max_model_len, args.port) == (8, 512, 9002)
    assert args.swap_space == 1 << 30
    assert args.enable_prefix_caching is False
    assert args.debug_endpoints is True and args.protect_metrics is False
    assert args.served_model_name is None
    assert args.allowed_origins == ["http://a.example", "http://b.example"]
    # --config=FILE spelling, and a flag before the file's overrides it too.
    args = _parse(["serve", "--max-num-seqs", "3", f"--config={path}"])
    assert (args.max_num_seqs, args.port) == (3, 9001)
    args = _parse(["serve", "--config", path, "--enable-prefix-caching"])
    assert args.enable_prefix_caching is True


def test_an_empty_config_file_changes_nothing(tmp_path) -> None:
    assert _parse(["serve", "--config", _write(tmp_path, "")]).port == 8000


@pytest.mark.parametrize(
    "text, message",
    [
        ("max_num_seq: 8\n", "'max_num_seq' is not a flag of kvserve serve (did you mean"),
        ("model_path: x\n", "'model_path' is not a flag of kvserve serve"),
        ("config: other.yaml\n", "'config' is not a flag of kvserve serve"),
        ("debug_endpoints: 1\n", "'debug_endpoints' takes true or false, got 1"),
        ("port: {a: 1}\n", "'port' takes a value or a list, got a mapping"),
        ("- port\n", "must map flag names to values, got list"),
        ("port: [1\n", "is not valid YAML"),
        ("port: eighty\n", "argument --port: invalid int value: 'eighty'"),
    ],
)
def test_bad_config_files_are_refused_naming_the_key(tmp_path, capsys, text, message) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(SystemExit) as e:
        _parse(["serve", "--config", path])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_config_file_is_named(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        _parse(["serve", "--config", str(tmp_path / "nope.yaml")])
    assert (
        f"--config: No such file or directory: {tmp_path / 'nope.yaml'}" in capsys.readouterr().err
    )
