"""Test-wide settings, applied before any test module imports torch."""

from __future__ import annotations

import os

import pytest

# NOTE: pytest rewrites asserts only in test modules; the shared helpers' checks must also
# hold under `python -O -m pytest` (issue 19), so they are rewritten too.
pytest.register_assert_rewrite(
    "tests.core.fake_runner",
    "tests.core.sched_helpers",
    "tests.server.openai_extras.common",
    "tests.tiny_models",
)

# NOTE: with 2 OpenMP threads on 2 cores, any other busy process (a server under test, a
# second pytest worker) makes spinning threads collapse throughput ~10x; passive waiting
# keeps the suite's wall time stable. Set before torch loads libgomp; subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# NOTE: every test traces its activation plans (a plan read back from an earlier run's disk
# cache would hide a change to a test's own model); test_plan_disk_cache turns it back on.
os.environ["KVSERVE_PLAN_CACHE"] = "0"
# NOTE: the Triton kernels are tested on CPU tensors under triton's interpreter, which triton
# picks at its import: set before anything imports it. A GPU run sets TRITON_INTERPRET=0 to
# compile them (bench/cuda/check.sh).
os.environ.setdefault("TRITON_INTERPRET", "1")
