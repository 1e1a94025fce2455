"""The native kernels' results on the other CPU kinds' code paths, run on this CPU.

The build compiles for ``-march=native``, so a suite on an AMX Xeon only ever runs the AMX and
AVX-512 branches of ``kvserve/runtime/native``; the AVX2 branches (the AVX2-only EPYC) and
the AVX-512-without-AMX ones (Zen 4, a Xeon whose hypervisor hides AMX) ran only when the
suite ran on such a machine. Here the kernels are built again for an older kind
(``KVSERVE_NATIVE_MARCH``, into a scratch cache) and the kernel tests run against that build
in a subprocess, with oneDNN capped the same way (``ONEDNN_MAX_CPU_ISA``) so torch's own
kernels take that kind's paths too. A kind is skipped where this CPU cannot run its code, or
where its code is what the normal suite already runs (an AVX2 CPU needs no AVX2 re-run).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvserve.runtime import native

ROOT = Path(__file__).resolve().parents[2]
# The tests whose results depend on the kernels' ISA branches.
KERNEL_TESTS = (
    "tests/runtime/test_native.py",
    "tests/runtime/test_attention.py",
    "tests/runtime/test_fused_layers.py",
    "tests/runtime/test_quant_kernels.py",
    "tests/runtime/test_kernel_scratch.py",  # the memory plan's model of torch's SDPA scratch
)


@dataclass(frozen=True)
class Kind:
    """A CPU kind: the gcc target, the flags this CPU needs to run it, the flag whose
    presence means the normal suite runs wider code than this kind's, the libraries' caps, and
    the quantized kernels' instruction set there (the build target caps it)."""

    march: str
    needs: frozenset[str]
    wider: str
    env: tuple[tuple[str, str], ...]
    quant_isa: str


KINDS = (
    # The AVX2-only EPYC (Zen 3): AVX2 + FMA + F16C, no AVX-512.
    Kind(
        "x86-64-v3",
        frozenset({"avx2", "fma", "f16c", "bmi2"}),
        "avx512f",
        (
            ("ONEDNN_MAX_CPU_ISA", "AVX2"),
            ("ATEN_CPU_CAPABILITY", "avx2"),
            ("MKL_ENABLE_INSTRUCTIONS", "AVX2"),
        ),
        "avx2",
    ),
    # Zen 4 / a Xeon without AMX: AVX-512 with VNNI and BF16, no AMX (gcc 12 has no znver4).
    Kind(
        "cooperlake",
        frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}),
        "amx_tile",
        (("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16"),),
        "avx512_vnni",
    ),
)

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("c++") is None,
    reason="x86-64 with a C++ compiler only",
)


def _env(kind: Kind, cache: Path) -> dict[str, str]:
    env = {**os.environ, **dict(kind.env)}
    env.update(KVSERVE_NATIVE_MARCH=kind.march, KVSERVE_CACHE_DIR=str(cache))
    env.pop("KVSERVE_NATIVE", None)
    return env


def _skip_reason(kind: Kind) -> str | None:
    flags = set(native.cpu_flags().split())
    if not kind.needs <= flags:
        return f"this CPU lacks {sorted(kind.needs - flags)} for {kind.march}"
    if kind.wider not in flags:
        return f"no {kind.wider} here: the normal suite already runs {kind.march}'s code"
    return None


# Builds both libraries and says which it loaded, whether the AMX kernel is there and the
# quantized kernels' instruction set.
PROBE = (
    "from kvserve.runtime import native, amx_linear; from kvserve.runtime.native import "
    "quant_ops; assert native.load() and quant_ops.load(), (native.reason(), "
    "quant_ops.reason()); print(native.build_dir(), amx_linear.amx_available(), "
    "quant_ops.best_isa())"
)


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int, str, str]]:
    """Every runnable kind's kernels, built concurrently (each build is one compiler process
    at a time: two kinds share the two cores): march -> (cache dir, rc, stdout, stderr)."""
    started: dict[str, tuple[Path, subprocess.Popen[str]]] = {}
    for kind in KINDS:
        if _skip_reason(kind) is None:
            cache = tmp_path_factory.mktemp(kind.march)
            started[kind.march] = (cache, subprocess.Popen(
                [sys.executable, "-c", PROBE], cwd=ROOT, env=_env(kind, cache),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ))  # fmt: skip
    done: dict[str, tuple[Path, int, str, str]] = {}
    for march, (cache, proc) in started.items():
        out, err = proc.communicate(timeout=600)
        done[march] = (cache, proc.returncode, out, err)
    return done


@pytest.mark.parametrize("kind", KINDS, ids=[k.march for k in KINDS])
def test_kernel_tests_pass_on_an_older_kinds_build(
    kind: Kind, builds: dict[str, tuple[Path, int, str, str]]
) -> None:
    skip = _skip_reason(kind)
    if skip is not None:
        pytest.skip(skip)
    # NOTE: the build is checked first: a failed build makes the kernel tests skip, not fail.
    cache, rc, out, err = builds[kind.march]
    assert rc == 0, err[-3000:]
    built, amx, quant_isa = out.split()
    assert Path(built).is_dir() and cache / "native" in Path(built).parents, built
    assert amx == "False"  # neither kind has AMX: its tile kernels must be compiled out
    assert quant_isa == kind.quant_isa  # not this CPU's wider one
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
        cwd=ROOT, env=_env(kind, cache), capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip
    tail = done.stdout[-4000:]
    assert done.returncode == 0, tail
    passed = re.search(r"(\d+) passed", tail)
    assert passed and int(passed.group(1)) >= 100, tail


def test_march_override_names_the_build_and_rejects_non_targets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(native.MARCH_ENV, raising=False)
    assert "-march=native" in native.cflags()
    default = native.build_name()
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v3")
    assert "-march=x86-64-v3" in native.cflags()
    assert native.build_name() != default  # a build for another kind never shadows this one's
    monkeypatch.setenv(native.MARCH_ENV, "native -O0")
    with pytest.raises(ValueError, match="KVSERVE_NATIVE_MARCH='native -O0'"):
        native.cflags()
