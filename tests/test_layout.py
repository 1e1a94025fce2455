"""The repository's layout, as a newcomer reads it (issue 48).

- The layers are folders: ``engine/``, ``core/kv/``, ``core/sched/``, ``runtime/autotune/``.
- No Python file (package or tests) is over ``MAX_PY_LINES`` lines, no C++ file over
  ``MAX_CPP_LINES``.
- ``docs/DESIGN.md``'s file map names every module of ``kvserve/``, and every path it names
  exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvserve"
MAX_PY_LINES = 500
MAX_CPP_LINES = 800
LAYERS = ("engine", "core/kv", "core/sched", "runtime/autotune", "runtime/attention", "models")


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_is_a_package(layer: str) -> None:
    assert (PACKAGE / layer / "__init__.py").is_file(), f"kvserve/{layer}/ is not a package"


def _files(pattern: str, *dirs: Path) -> list[Path]:
    return sorted(p for d in dirs for p in d.rglob(pattern) if "__pycache__" not in p.parts)


def test_no_python_file_is_large() -> None:
    big = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in _files("*.py", PACKAGE, ROOT / "tests")
        if (n := len(p.read_text().splitlines())) > MAX_PY_LINES
    ]
    assert not big, f"over {MAX_PY_LINES} lines (split by responsibility):\n" + "\n".join(big)


def test_no_cpp_file_is_large() -> None:
    sources = _files("*.cpp", PACKAGE) + _files("*.h", PACKAGE)
    assert sources, "no native sources found"
    big = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in sources
        if (n := len(p.read_text().splitlines())) > MAX_CPP_LINES
    ]
    assert not big, f"over {MAX_CPP_LINES} lines (one op to a file):\n" + "\n".join(big)


def _file_map() -> set[str]:
    """The ``kvserve/``-relative paths in backticks under DESIGN.md's '## File map'."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    match = re.search(r"^## File map\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, "docs/DESIGN.md has no '## File map' section"
    return set(re.findall(r"`([\w/]+\.(?:py|cpp|h))`", match.group(1)))


def _modules() -> set[str]:
    return {p.relative_to(PACKAGE).as_posix() for p in _files("*.py", PACKAGE)}


def test_design_file_map_names_every_module() -> None:
    missing = sorted(_modules() - _file_map())
    assert not missing, "docs/DESIGN.md's file map leaves out:\n" + "\n".join(missing)


def test_design_file_map_names_only_what_exists() -> None:
    stale = sorted(p for p in _file_map() if not (PACKAGE / p).is_file())
    assert not stale, "docs/DESIGN.md's file map names files that do not exist:\n" + "\n".join(
        stale
    )
