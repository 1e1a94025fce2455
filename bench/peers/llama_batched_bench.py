"""llama.cpp offline peer: run ``llama-batched-bench`` and turn its table into records.

    python bench/peers/llama_batched_bench.py --bin BUILD/bin/llama-batched-bench \
        --model M.gguf --npp 128 --ntg 128 --batch-sizes 1 8 32 --out-dir bench/out/run

NOTE: batched-bench makes its own prompts (not the trace's ids); lengths match the trace.
Generated tokens/s e2e = B x ntg / T (prefill + decode wall), as in PEERS.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))

import peer_record  # noqa: E402


def parse_table(text: str) -> list[dict[str, float]]:
    """Rows of the markdown table (| PP | TG | B | N_KV | T_PP s | S_PP t/s | ... |)."""
    rows, header = [], None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "PP" in cells and "TG" in cells and "B" in cells:
            header = cells
        elif header and len(cells) == len(header) and cells[0].replace(".", "").isdigit():
            rows.append({h: float(c) for h, c in zip(header, cells, strict=True)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--npp", type=int, default=128)
    ap.add_argument("--ntg", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--version", default="unknown")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--system", default="llama.cpp", help="the records' system name")
    ap.add_argument("--weights", default="Q4_1 (GGUF)", help="the records' dtype field")
    args = ap.parse_args(argv)
    cmd = [
        args.bin,
        "-m",
        args.model,
        "-t",
        str(args.threads),
        "-tb",
        str(args.threads),
        "-c",
        "16384",
        "-b",
        "2048",
        "-ub",
        "512",
        "-npp",
        str(args.npp),
        "-ntg",
        str(args.ntg),
        "-npl",
        ",".join(map(str, args.batch_sizes)),
    ]
    print(" ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = parse_table(proc.stdout)
    if not rows:
        raise RuntimeError(f"no table in llama-batched-bench output:\n{proc.stdout[-2000:]}")
    for row in rows:
        b = int(row["B"])
        rec = peer_record.throughput_record(
            args.system,
            args.version,
            b,
            b * args.npp,
            b * args.ntg,
            row["T s"],
            b,
            prefill_tokens_per_s=row["S_PP t/s"],
            decode_tokens_per_s=row["S_TG t/s"],
            dtype=args.weights,
        )
        peer_record.write(rec, args.out_dir, f"offline_{args.system}_b{b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
