"""The native kernels' build: a lock left by a killed build costs no rebuild, a build killed
midway resumes where it stopped (saying so), and two checkouts keep two build directories."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.runtime import native

pytestmark = pytest.mark.skipif(
    os.environ.get(native.DISABLE_ENV) == "0", reason=f"{native.DISABLE_ENV}=0"
)


def _load_in(directory: Path) -> subprocess.CompletedProcess[str]:
    """Load the kernels built in ``directory`` in a fresh process (building what is missing),
    as a start-up does."""
    load = (
        "import sys; from pathlib import Path; from kvserve.runtime import native as n; "
        "n.build_extension(n.build_name(), n.SOURCES, Path(sys.argv[1]), 'the native CPU kernels')"
    )
    done = subprocess.run(
        [sys.executable, "-c", load, str(directory)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_a_lock_left_by_a_killed_build_costs_no_rebuild() -> None:
    """torch waits on its build directory's ``lock`` file while it exists; a build killed
    midway left one, and every later start-up waited on it forever. Removing it must not cost
    a rebuild either (a first start once sat 199 s after it): the built library is loaded as it
    is, silently."""
    assert native.load(), native.reason()
    directory = native.build_dir()
    library = directory / f"{native.build_name()}.so"
    built = library.stat().st_mtime_ns
    assert native.pending_steps(directory, native.build_name()) == 0
    baton = directory / "lock"
    baton.touch()  # what the killed build left (it held no flock any more)
    try:
        done = _load_in(directory)
        assert not baton.exists()
        assert library.stat().st_mtime_ns == built
        assert "kvserve:" not in done.stderr  # nothing built, nothing said
    finally:
        baton.unlink(missing_ok=True)


def test_a_build_killed_midway_resumes_and_says_so(tmp_path: Path) -> None:
    """A build killed before it compiled one file (and before the link) left the others: the
    next start compiles that file only, saying so, and links."""
    assert native.load(), native.reason()
    copy = tmp_path / "build"
    shutil.copytree(native.build_dir(), copy)  # the session's build, mtimes kept
    (copy / f"{native.build_name()}.so").unlink()
    (copy / "rope.o").unlink()
    (copy / "lock").touch()
    kept = {obj.name: obj.stat().st_mtime_ns for obj in copy.glob("*.o")}
    assert native.pending_steps(copy, native.build_name()) == 2  # rope.cpp and the link
    done = _load_in(copy)
    lines = [line for line in done.stderr.splitlines() if line.startswith("kvserve:")]
    assert "building the native CPU kernels" in lines[0] and "(resuming)" in lines[0]
    assert any("[1/1] compiled rope.cpp" in line for line in lines), lines
    assert "built the native CPU kernels in" in lines[-1]
    assert (copy / f"{native.build_name()}.so").exists() and (copy / "rope.o").exists()
    assert {obj: (copy / obj).stat().st_mtime_ns for obj in kept} == kept  # not recompiled
    assert native.pending_steps(copy, native.build_name()) == 0


def test_two_checkouts_build_in_two_directories(tmp_path: Path) -> None:
    """The ninja file names the sources' paths: a checkout elsewhere (here: a package
    directory at another path) gets a directory of its own instead of rebuilding this one's."""
    here = native.checkout_key()
    assert native.build_dir().parent.name == here
    elsewhere = tmp_path / "other-checkout" / "kvserve" / "runtime" / "native"
    elsewhere.mkdir(parents=True)
    other = native.checkout_key(elsewhere)
    assert other != here and other.startswith("other-checkout-")
    assert native.checkout_key(Path(native.__file__).parent) == here
