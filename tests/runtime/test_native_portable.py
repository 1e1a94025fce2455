"""The native sources compile for every CPU kind this project lands on, not only this one.

The build uses ``-march=native``, so a machine compiles only what its own CPU enables: code
under a ``target`` attribute that needs more than the enclosing function enables (a lambda
inside an AVX-512 function does not inherit the attribute) builds on an AVX-512 CPU and fails
on an AVX2-only one, taking every quantized kernel with it. This happened (the Zen 3 EPYC
(AVX2), 2026-12-02). Each source is compiled here, without optimization (the quickest codegen
that still checks inlining and immediates), for the AVX2 baseline, AVX-512 without BF16 and the
widest kind (AMX).
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from kvserve.runtime import native
from kvserve.runtime.native import quant_ops

# x86-64-v3: AVX2 + FMA + F16C (the AVX2-only EPYC); icelake-server: AVX-512 without BF16
# (the kernels' non-BF16 AVX-512 branches); sapphirerapids: AVX-512 VNNI/BF16 + AMX.
MARCHES = ("x86-64-v3", "icelake-server", "sapphirerapids")
# NOTE: only the sources with instruction-set code of their own (intrinsics, target
# attributes, the arch/ and attention/ headers, the quantized kernels' common header): a file
# without any (the bindings, rope, write_kv, the layer loop) compiles alike for every kind.
ISA_CODE = re.compile(
    r"target\(|__m(?:256|512)|_mm\d*_|#include \"(?:\.\./)?(?:arch|attention)/|quant_common\.h"
)
SOURCES = tuple(s for s in (*native.SOURCES, *quant_ops.SOURCES) if ISA_CODE.search(s.read_text()))

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("c++") is None,
    reason="x86-64 with a C++ compiler only",
)


# NOTE: parsing the ATen headers is ~70 % of each -O0 compile; one precompiled header per
# kind (same flags, so gcc accepts it) cuts the test from ~80 s to well under half.
PCH_HEADERS = ("ATen/Dispatch.h", "ATen/Parallel.h", "ATen/core/Tensor.h", "immintrin.h")


def _flags(march: str) -> list[str]:
    includes = [f"-isystem{p}" for p in (*include_paths(), sysconfig.get_paths()["include"])]
    return [
        "-std=c++20", "-O0", f"-march={march}", "-fopenmp", *includes,
        "-DTORCH_EXTENSION_NAME=portable_check", "-DTORCH_API_INCLUDE_EXTENSION_H",
    ]  # fmt: skip


def _run(cmd: list[str], what: str) -> tuple[str, int, str]:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    return what, done.returncode, "\n".join(errors[:5])


def _precompile(march: str, out_dir: Path) -> tuple[str, int, str]:
    header = out_dir / march / "pch.h"
    header.parent.mkdir()
    header.write_text("".join(f"#include <{h}>\n" for h in PCH_HEADERS))
    cmd = [*_flags(march), "-x", "c++-header", str(header), "-o", f"{header}.gch"]
    return _run(["c++", *cmd], f"precompiled ATen headers -march={march}")


def _compile(source: Path, march: str, out_dir: Path) -> tuple[str, int, str]:
    pch = ["-include", str(out_dir / march / "pch.h"), "-Winvalid-pch"]
    out = out_dir / f"{source.stem}-{march}.o"
    cmd = ["c++", *_flags(march), *pch, "-c", str(source), "-o", str(out)]
    return _run(cmd, f"{source.name} -march={march}")


def test_native_sources_compile_for_every_cpu_kind(tmp_path: Path) -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda march: _precompile(march, tmp_path), MARCHES))
        if all(rc == 0 for _, rc, _ in results):
            jobs = [(src, march) for src in SOURCES for march in MARCHES]
            results += pool.map(lambda job: _compile(*job, tmp_path), jobs)
    failed = [f"{what}:\n{errors}" for what, rc, errors in results if rc != 0]
    assert not failed, "\n".join(failed)
