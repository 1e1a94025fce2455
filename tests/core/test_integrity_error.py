"""check_integrity raises IntegrityError, explicitly, so it also works under ``python -O``."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.core import IntegrityError, KVCacheManager
from tests.core.fake_runner import make_request

ROOT = Path(__file__).resolve().parents[2]

PLANT = """
from kvserve.core import IntegrityError, KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

kv = KVCacheManager(8, 4)
r = Request(request_id="r", prompt_token_ids=[1, 2, 3, 4, 5], sampling_params=SamplingParams())
kv.allocate_slots(r, 5)
kv.check_integrity()
kv.block_pool.blocks[0].ref_cnt += 1  # planted: a reference nobody holds
try:
    kv.check_integrity()
except IntegrityError as e:
    print("reported:", e)
else:
    print("missed")
"""


def test_a_planted_violation_is_an_integrity_error() -> None:
    kv = KVCacheManager(8, 4)
    r = make_request("r", [1, 2, 3, 4, 5], max_tokens=2)
    assert kv.allocate_slots(r, 5) is not None
    kv.check_integrity()
    kv.block_pool.blocks[0].ref_cnt += 1
    with pytest.raises(IntegrityError, match="block 0: ref 2 but held by 1"):
        kv.check_integrity()
    assert issubclass(IntegrityError, AssertionError)  # callers catching that still see it


def test_a_planted_violation_is_reported_under_python_O() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-O", "-c", PLANT], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "reported: block 0: ref 2 but held by 1 tables / copy pins"


def test_no_assert_statement_in_core() -> None:
    """``assert`` vanishes under -O: the core's checks raise explicitly."""
    offenders = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in sorted((ROOT / "kvserve" / "core").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assert)
    ]
    assert not offenders, "assert statements in kvserve/core:\n" + "\n".join(offenders)
