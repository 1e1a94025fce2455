"""Where a throughput run's time goes by step kind: pure decode steps by row count, steps
with a prefill chunk, from the engine's own ``step_records``.

    PYTHONPATH=. .venv/bin/python bench/probes/step_mix.py [kvserve bench throughput flags]
    # e.g. --workload-file W --num-prompts 64 --max-num-seqs 32 --num-threads 2 --quiet

Runs ``kvserve bench throughput`` with the given flags (its usual figures first), then prints
the run's steps grouped as "decode" (no prefill token), "mixed" (decodes and a chunk) and
"prefill" (chunks only), by decode rows in bins of 8: steps, seconds, ms a step and the
runner's share (``execute_seconds``); then each decode-only row count with its steps, ms a
step and mean context per sequence (the K/V a step's attention reads grows with it).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Any

import kvserve.bench.throughput as throughput
from kvserve import cli


def main() -> None:
    engines: list[Any] = []
    build = throughput.build_engine

    def keep(*args: Any, **kwargs: Any) -> Any:
        engines.append(build(*args, **kwargs))
        return engines[-1]

    throughput.build_engine = keep
    cli.main(["bench", "throughput", *sys.argv[1:]])
    records = engines[0].step_records
    kinds: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    decodes: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for r in records:
        d, p = int(r["num_decode_tokens"]), int(r["num_prefill_tokens"])
        kind = "decode" if p == 0 else "mixed" if d else "prefill"
        acc = kinds[(kind, (d + 7) // 8 * 8)]
        acc[0] += 1
        acc[1] += r["seconds"]
        acc[2] += r["execute_seconds"]
        if p == 0:
            decodes[d].append((r["execute_seconds"], r["num_context_tokens"] / r["num_seqs"]))
    print(f"\n{len(records)} steps, {sum(r['seconds'] for r in records):.2f} s")
    for (kind, rows), (n, s, e) in sorted(kinds.items()):
        print(
            f"{kind:8s} decodes <= {rows:3d}: {n:5d} steps {s:7.2f} s "
            f"({s / n * 1e3:6.2f} ms a step, runner {e / n * 1e3:6.2f})"
        )
    print("decode-only steps by rows: steps, runner ms a step, mean context per sequence")
    for rows, v in sorted(decodes.items()):
        ms = sum(e for e, _ in v) / len(v) * 1e3
        ctx = sum(c for _, c in v) / len(v)
        print(f"rows {rows:3d}: {len(v):4d} steps {ms:6.2f} ms, context {ctx:5.0f}")


if __name__ == "__main__":
    main()
