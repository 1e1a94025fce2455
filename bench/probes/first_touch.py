"""How long a KV-pool-sized buffer takes to fault in: ordinary pages, huge pages, and
``zeros_huge`` (huge pages until they come in slowly).

    PYTHONPATH=. .venv/bin/python bench/probes/first_touch.py [--gib 2.3] [--rounds 2]

Per round, each way on a fresh buffer of ``--gib`` GiB (freed before the next):
``torch.empty().zero_()`` (4 KiB pages under THP's ``madvise`` mode), ``zeros_huge`` with
its fallback off (huge pages asked for the whole buffer, as before session 17) and
``zeros_huge`` as the engine calls it. Whether huge pages are slow depends on how
fragmented the host's memory is at that moment (the kernel compacts memory to make them):
the first round after a long uptime is the telling one. The THP settings are printed.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from kvserve.runtime.huge_pages import zeros_huge

CPU = torch.device("cpu")


def _timed(fn: object) -> float:
    t0 = time.perf_counter()
    buf = fn()  # type: ignore[operator]
    elapsed = time.perf_counter() - t0
    del buf
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.3)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="  %(name)s: %(message)s")
    for name in ("enabled", "defrag"):
        path = Path("/sys/kernel/mm/transparent_hugepage") / name
        print(f"THP {name}: {path.read_text().strip() if path.exists() else 'n/a'}")
    n = int(args.gib * 2**30)
    ways = {
        "ordinary pages": lambda: torch.empty(n, dtype=torch.uint8).zero_(),
        "huge pages, no fallback": lambda: zeros_huge(
            (n,), torch.uint8, CPU, small_page_rate=lambda: 0.0
        ),
        "zeros_huge (engine)": lambda: zeros_huge((n,), torch.uint8, CPU),
    }
    for r in range(args.rounds):
        for way, fn in ways.items():
            print(f"round {r + 1} {time.strftime('%H:%M:%S')} {way:26s} {_timed(fn):7.2f} s")


if __name__ == "__main__":
    main()
