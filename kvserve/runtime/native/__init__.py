"""Native CPU kernels: fused per-layer ops and paged decode attention, in C++.

The sources are under ``csrc/``, one op to a file, with a vector header per instruction set
(``csrc/arch/``); README.md beside this file has the map, the numerics and how the build is
cached. They make one op library, ``torch.ops.kvserve``: ``add_rms_norm``, ``rope_``,
``write_kv``, ``paged_decode_attention``, ``silu_mul``, ``argmax_rows``, ``decode_layers`` (every
decoder layer of a step in one call, ``kvserve/models/fused_layers.py``), ``amx_linear``,
``amx_prefill_attention`` and ``amx_int8_linear`` (AMX kernels, with their ``*_supported``
checks); ``quant_ops.py`` builds ``csrc/quant/`` into a second one, ``torch.ops.kvserve_quant``.

They are built on first use with ``torch.utils.cpp_extension`` (g++ and ninja, ~30 s on a
2-core box; each file compiles on its own, so a build killed midway resumes where it stopped)
into ``$KVSERVE_CACHE_DIR/native/<checkout>/<name>`` (default ``~/.cache/kvserve/native/``):
``<checkout>`` keys the checkout and the torch installation (two checkouts never rebuild each
other's build), ``<name>`` the sources, the compiler flags, the torch version and the CPU's
feature flags (the build uses ``-march=native``, or the target in ``$KVSERVE_NATIVE_MARCH``).
A build says so on stderr and reports each file as it compiles; a later process only loads the
built library, silently.

``load()`` never raises: without a compiler, or with ``KVSERVE_NATIVE=0`` in the
environment, it returns False once, logs why, and the model runs its torch ops instead
(``reason()`` says why). ``make run`` and ``make test`` build the kernels first (``python -m
kvserve.runtime.native``), so no request waits for the compiler.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from kvserve.cache_dir import cache_root

CSRC = Path(__file__).with_name("csrc")
# NOTE: one op library from these files; bindings.cpp registers every op of them.
SOURCES = tuple(
    CSRC / name
    for name in (
        "bindings.cpp",
        "rms_norm.cpp",
        "rope.cpp",
        "write_kv.cpp",
        "silu_mul.cpp",
        "argmax.cpp",
        "decode_attention.cpp",
        "decode_layers.cpp",
        "amx_linear.cpp",
        "amx_attention.cpp",
        "amx_int8.cpp",
    )
)
# Headers the sources include: hashed into the build name with them.
HEADERS = tuple(sorted(h for h in CSRC.rglob("*.h") if h.parent.name != "quant"))
DISABLE_ENV = "KVSERVE_NATIVE"  # "0" turns the native kernels off
# NOTE: "native" unless KVSERVE_NATIVE_MARCH names a gcc -march target (x86-64-v3, cooperlake, ...):
# building for an older CPU kind than this one runs that kind's code paths here (AVX2 without
# AVX-512, AVX-512 without AMX), which is how the tests check them on whichever CPU CI has.
MARCH_ENV = "KVSERVE_NATIVE_MARCH"
# NOTE: linking -fopenmp records a need for libgomp.so.1; torch's own libgomp.so.1 is loaded
# first and has that soname, so the kernels' at::parallel_for shares torch's OpenMP threads.
LDFLAGS = ("-fopenmp",)

log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, object] = {}


def march() -> str:
    """The gcc ``-march`` target the kernels build for: ``$KVSERVE_NATIVE_MARCH`` or ``native``."""
    target = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not all(ch.isalnum() or ch in "-_." for ch in target):
        raise ValueError(f"{MARCH_ENV}={target!r} is not a gcc -march target name")
    return target


def cflags() -> tuple[str, ...]:
    """The compiler flags: ``-march`` from ``$KVSERVE_NATIVE_MARCH`` (default ``native``).

    A build for a named target also defines ``KVSERVE_EMULATED_TARGET``: the quantized kernels
    then take only the instruction sets that target has (csrc/quant/quant_common.h,
    ``target_has``),
    so an older kind's build runs that kind's kernels on a newer CPU. A native build picks them
    by the CPU's flags alone.
    """
    target = march()
    emulated = () if target == "native" else ("-DKVSERVE_EMULATED_TARGET",)
    return ("-O3", f"-march={target}", "-fopenmp", *emulated)


def cpu_flags() -> str:
    """The CPU's feature flags (from /proc/cpuinfo), which ``-march=native`` compiles for."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def build_name() -> str:
    """Extension name: source, flags, torch version and CPU features hashed together."""
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.read_bytes())
    for part in (*cflags(), *LDFLAGS, torch.__version__, cpu_flags()):
        h.update(part.encode())
    return f"kvserve_cpu_ops_{h.hexdigest()[:16]}"


def checkout_key(package: Path | None = None) -> str:
    """This checkout (``package``: this package's directory) and torch installation: the
    paths a build's ninja file names.

    NOTE: ``build.ninja`` names the sources by their absolute paths and torch's and Python's
    include and library directories; a second checkout (or venv) building into the same
    directory rewrote it and recompiled everything, and the first one did the same on its next
    start. Each keeps its own directory instead: the checkout's folder name (to tell them
    apart by eye) and a hash of those paths.
    """
    package = Path(__file__).parent if package is None else package
    package = package.resolve()
    h = hashlib.sha256()
    for part in (package, Path(torch.__file__).resolve().parent, sysconfig.get_paths()["include"]):
        h.update(str(part).encode() + b"\0")
    return f"{package.parents[2].name}-{h.hexdigest()[:8]}"


def build_dir() -> Path:
    """Where the kernels are built and kept."""
    return cache_root() / "native" / checkout_key() / build_name()


def ensure_ninja_on_path() -> None:
    """Put the venv's ninja on PATH: ``.venv/bin/python`` runs without the venv activated."""
    if shutil.which("ninja"):
        return
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja  # the PyPI package ships the binary

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    os.environ["PATH"] = os.pathsep.join([*dirs, os.environ.get("PATH", "")])


def _register_fakes() -> None:
    """Fake kernels: every op only writes into its arguments, so tracing has nothing to do."""
    for op in (
        "add_rms_norm",
        "rope_",
        "write_kv",
        "paged_decode_attention",
        "silu_mul",
        "argmax_rows",
        "decode_layers",
        "amx_linear",
        "amx_int8_linear",
        "amx_prefill_attention",
    ):
        torch.library.register_fake(f"kvserve::{op}")(lambda *args, **kwargs: None)


def build_extension(
    name: str, sources: Sequence[Path], directory: Path, what: str, verbose: bool = False
) -> None:
    """Build (when needed, saying so on stderr with each file's progress) and load ``sources``
    as the op library ``name`` in ``directory``, with this package's compiler flags. ``what``:
    e.g. "the native CPU kernels (~30 s)"."""
    from torch.utils import cpp_extension

    ensure_ninja_on_path()
    directory.mkdir(parents=True, exist_ok=True)
    with build_lock(directory):
        steps = pending_steps(directory, name)
        progress = BuildProgress(directory, sources, steps, what) if steps else None
        try:
            cpp_extension.load(
                name=name,
                sources=[str(src) for src in sources],
                extra_cflags=list(cflags()),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(directory),
                is_python_module=False,
                verbose=verbose,
            )
        except BaseException:
            if progress is not None:
                progress.stop(failed=True)
            raise
        if progress is not None:
            progress.stop()


def pending_steps(directory: Path, name: str) -> int:
    """How many build steps (compiles and the link) a load in ``directory`` runs: 0 when the
    library there is complete and up to date, so that loading it prints nothing.

    NOTE: ninja decides, from the ninja file and its log of the last build (``ninja -n``, a
    dry run, ~10 ms): a build that was killed midway left the files it had compiled, and only
    the others (and the link) are pending. Without a ninja file: everything (-1, counted by
    the progress lines as the number of sources).
    """
    if not (directory / "build.ninja").exists():
        return -1
    try:
        done = subprocess.run(
            ["ninja", "-C", str(directory), "-n"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return -1
    if done.returncode != 0:
        return -1
    steps = sum(1 for line in done.stdout.splitlines() if line.startswith("["))
    return steps if (directory / f"{name}.so").exists() else max(1, steps)


class BuildProgress:
    """The stderr lines of a build: one before it starts, one as each file is compiled (its
    object file written since the start), a heartbeat while none finishes, and the time it
    took. Lines, not a redrawn bar, so that logs and pipes keep them."""

    HEARTBEAT_S = 20.0

    def __init__(self, directory: Path, sources: Sequence[Path], steps: int, what: str) -> None:
        self.directory, self.what = directory, what
        self.objects = {f"{Path(src).stem}.o": Path(src).name for src in sources}
        # compiles pending: ninja's count less the link, or every source when unknown
        self.total = steps - 1 if steps > 0 else len(self.objects)
        self.started = time.time()
        self.seen: set[str] = set()
        self._stop = threading.Event()
        first = "first start with these sources on this machine" if steps < 0 else "resuming"
        self.say(f"building {what} into {directory} ({first}) ...")
        self._thread = threading.Thread(target=self._watch, name="kvserve-build", daemon=True)
        self._thread.start()

    @staticmethod
    def say(line: str) -> None:
        print(f"kvserve: {line}", file=sys.stderr, flush=True)

    def poll(self) -> bool:
        """Report the files compiled since the last poll; True when there were any."""
        fresh = False
        for obj, src in self.objects.items():
            if obj in self.seen:
                continue
            try:
                compiled = (self.directory / obj).stat().st_mtime >= self.started - 1.0
            except OSError:
                continue
            if compiled:
                self.seen.add(obj)
                fresh = True
                done = len(self.seen)
                elapsed = time.time() - self.started
                self.say(f"[{done}/{max(done, self.total)}] compiled {src} ({elapsed:.0f} s)")
        return fresh

    def _watch(self) -> None:
        quiet_since = time.time()
        while not self._stop.wait(0.5):
            if self.poll():
                quiet_since = time.time()
            elif time.time() - quiet_since >= self.HEARTBEAT_S:
                quiet_since = time.time()
                self.say(f"... still compiling ({time.time() - self.started:.0f} s)")

    def stop(self, failed: bool = False) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()
        what = self.what.split(" (~")[0]  # the estimate is for the first line
        took = time.time() - self.started
        self.say(
            f"building {what} failed after {took:.0f} s"
            if failed
            else f"built {what} in {took:.0f} s"
        )


@contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold an OS file lock on ``directory`` while torch builds or loads there, and clear the
    ``lock`` file a killed build left behind.

    NOTE: torch's ``cpp_extension`` guards a build directory with a ``lock`` file that it
    waits on while it exists; a build killed midway left it there, and every later start-up
    waited forever. An ``flock`` is released by the OS when its holder dies, so while this
    one is held no other kvserve process is building here and a ``lock`` file is stale.
    Clearing it costs no rebuild: ninja then finds the library complete (nothing to do) or
    compiles only the files the killed build had not finished.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock only
        yield
        return
    with open(directory / "kvserve-build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        baton = directory / "lock"
        if baton.exists():
            log.info("removing %s, left by a build that was killed", baton)
            baton.unlink(missing_ok=True)
        yield


def _build(verbose: bool) -> None:
    build_extension(build_name(), SOURCES, build_dir(), "the native CPU kernels (~30 s)", verbose)
    _register_fakes()


def load_once(
    state: dict[str, object],
    lock: threading.Lock,
    build: Callable[[], None],
    logger: logging.Logger,
    unavailable: str,
) -> bool:
    """Run ``build`` once, unless ``KVSERVE_NATIVE=0``, and remember in ``state`` whether it
    worked (``"ok"``) and why not (``"reason"``); True when it did. A failure is logged as
    "``unavailable``: reason". The native and the quantized-weight kernels load this way."""
    # NOTE: the outcome never changes once known, and the model asks per layer: no lock then.
    known = state.get("ok")
    if known is not None:
        return bool(known)
    with lock:
        if "ok" not in state:
            if os.environ.get(DISABLE_ENV, "1") == "0":
                state.update(ok=False, reason=f"disabled by {DISABLE_ENV}=0")
            else:
                try:
                    build()
                    state.update(ok=True, reason=None)
                except Exception as exc:  # noqa: BLE001 - any build failure: run without them
                    state.update(ok=False, reason=f"{type(exc).__name__}: {exc}")
                    logger.warning("%s: %s", unavailable, state["reason"])
        return bool(state["ok"])


def load(verbose: bool = False) -> bool:
    """Build (first time) and load the kernels; True when ``torch.ops.kvserve`` has them."""
    return load_once(
        _state,
        _lock,
        lambda: _build(verbose),
        log,
        "native CPU kernels unavailable, using torch ops",
    )


def available() -> bool:
    """Whether the native kernels are loaded (building them on the first call)."""
    return load()


def reason() -> str | None:
    """Why the kernels are unavailable (None when loaded or not tried yet)."""
    return _state.get("reason")  # type: ignore[return-value]


def ops() -> object:
    """``torch.ops.kvserve``; call only after ``load()`` returned True."""
    return torch.ops.kvserve
