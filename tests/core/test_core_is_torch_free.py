"""core/ (memory + scheduling) must not import torch: it is tested in milliseconds and reused
by the simulator on machines without a model runtime."""

from __future__ import annotations

import subprocess
import sys


def test_importing_core_and_scheduler_loads_no_torch() -> None:
    code = (
        "import sys, kvserve.core, kvserve.core.sched.scheduler, kvserve.core.kv.window, "
        "kvserve.core.kv.host_tier, kvserve.request, kvserve.sampling_params, kvserve.config\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
