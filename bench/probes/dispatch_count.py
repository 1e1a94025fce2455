"""How many ops a bare decode step dispatches, and how long its kernels take replayed alone.

    KVSERVE_FUSED_LAYERS=0 PYTHONPATH=. .venv/bin/python bench/probes/dispatch_count.py \\
        --batch-sizes 1 8 --steps 8 --prompt-len 128 --threads 2 --repeats 1

Runs ``kvserve.bench.runtime_speed`` and, after each batch size's decode, one more step of
the same batch: under a ``TorchDispatchMode`` that counts every op it dispatches (printed by
op), then ``runner.execute`` timed alone 200 times, then the step's kernel ops (the
``kvserve*`` namespaces) replayed 200 times from a Python list with the arguments they were
called with (the same slots and tables, so the replay rewrites the same K/V). The replay is
the step without the Python around its kernels; execute minus replay is that Python.
``KVSERVE_FUSED_LAYERS=0`` measures the layer-by-layer path (the fused one dispatches one op
for all layers).
"""

from __future__ import annotations

import collections
import statistics
import sys
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvserve.bench import runtime_speed
from kvserve.core.outputs import SchedulerOutput
from kvserve.runtime.model_runner import ModelRunner


class _Record(TorchDispatchMode):
    """Keeps every dispatched op with its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _median_ms(fn: Any, n: int = 200) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _probe(runner: ModelRunner, prefilled: dict[str, list[int]], tables: Any) -> None:
    seqs = {rid: list(t) for rid, t in prefilled.items()}
    sched = SchedulerOutput(
        scheduled=[runtime_speed._req(r, t, len(t) - 1, len(t), tables[r]) for r, t in seqs.items()]
    )
    record = _Record()
    with record:
        runner.execute(sched)
    counts = collections.Counter(str(f) for f, _, _ in record.calls)
    print(f"B={len(seqs)}: {len(record.calls)} ops dispatched in one step")
    for name, n in counts.most_common(12):
        print(f"  {n:5d} {name}")
    kernels = [c for c in record.calls if str(c[0]).startswith("kvserve")]

    def replay() -> None:
        for func, args, kwargs in kernels:
            func(*args, **kwargs)

    with torch.inference_mode():
        execute = _median_ms(lambda: runner.execute(sched))
        kernel_ms = _median_ms(replay)
    print(
        f"  runner.execute median {execute:.3f} ms; its {len(kernels)} kernel ops replayed "
        f"alone {kernel_ms:.3f} ms"
    )


def main(argv: list[str]) -> None:
    decode = runtime_speed._decode

    def decode_then_probe(runner: Any, prefilled: Any, tables: Any, steps: int) -> Any:
        result = decode(runner, prefilled, tables, steps)
        _probe(runner, prefilled, tables)
        return result

    runtime_speed._decode = decode_then_probe
    runtime_speed.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
