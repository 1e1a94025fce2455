"""``kvserve bench kernels``: every projection kernel candidate timed per M bucket.

    python -m kvserve.cli bench kernels [--model PATH] [--dtype float32 bfloat16]
        [--threads 2] [--json PATH]

For the model's projection shapes (qkv, o, gate/up, down, lm_head) and each M bucket
(decode 1, 2-8, 9-16, 17-32, 33-128; prefill chunks 129-256 and above, probed at 256 and 512
rows), each candidate runs as at start-up (``kvserve.runtime.autotune``, mode ``measure``:
the cache is refreshed). One row per shape x bucket x candidate: best ms per call, weight
GB/s, GFLOP/s and whether it was chosen; then each decode bucket's step check
(``autotune.check``: the plans tried on whole steps' projections, ms a step, the one taken).
The last lines give the decode matmul time per dtype (M = 1, 8 and 32 summed, chosen
kernels) and what ``--dtype auto`` would pick (``autotune.measure_dtype.dtype_speedup``:
those matmuls and decode attention, dense weights).
"""

from __future__ import annotations

import argparse
import json

import torch

from kvserve.models.loader import load_arch
from kvserve.runtime.autotune.candidates import (
    DTYPES,
    cpu_identity,
    m_buckets,
    native_bf16,
    projection_shapes,
)
from kvserve.runtime.autotune.choose import Selection
from kvserve.runtime.autotune.measure_dtype import dtype_speedup
from kvserve.runtime.autotune.tune import decode_matmul_seconds, select_shapes
from kvserve.runtime.linear import M_MAX


def _bucket(max_m: int) -> str:
    if max_m != M_MAX:
        return f"<={max_m}"
    return f">{m_buckets()[-2][0]}"


def table(sel: Selection, names: dict[tuple[int, int], str]) -> list[str]:
    """The rows of ``sel``'s timings (see the module docstring)."""
    lines = [
        f"{'shape':>18} {'M':>5} {'rows':>5} {'candidate':<24} {'ms':>9} {'GB/s':>7} "
        f"{'GFLOP/s':>8}  chosen"
    ]
    for t in sel.timings:
        shape = (t.out_features, t.in_features)
        label = f"{names.get(shape, '')} {t.out_features}x{t.in_features}"
        if t.seconds is None:
            lines.append(
                f"{label:>18} {_bucket(t.max_m):>5} {t.probe_m:>5} {t.candidate:<24} "
                f"failed: {t.error}"
            )
            continue
        mark = "*" if sel.chosen(shape, t.max_m) == t.candidate else ""
        lines.append(
            f"{label:>18} {_bucket(t.max_m):>5} {t.probe_m:>5} {t.candidate:<24} "
            f"{t.seconds * 1e3:9.3f} {t.gbytes_per_s:7.1f} {t.gflops:8.1f}  {mark}"
        )
    return lines


def check_lines(sel: Selection, names: dict[tuple[int, int], str]) -> list[str]:
    """One line per plan of each step check in ``sel`` (see the module docstring)."""
    lines = []
    for c in sel.checks:
        bucket = _bucket(int(c["max_m"]))  # type: ignore[call-overload]
        for k, (plan, seconds) in enumerate(c["plans"]):  # type: ignore[arg-type]
            what = ", ".join(f"{names.get((o, i), f'{o}x{i}')} {n}" for o, i, n in plan)
            mark = "  *" if k == c["chosen"] else ""
            lines.append(
                f"step check M{bucket:>5} ({c['rows']} rows): {seconds * 1e3:7.3f} ms  {what}{mark}"
            )
    return lines


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF dir (default: embedded)")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="write the timings to this JSON file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    arch = load_arch(args.model)
    counts = projection_shapes(arch)
    h = arch.hidden_size
    names = dict(zip(list(counts), ["qkv", "o", "gate_up", "down"], strict=False))
    names[(arch.vocab_size, h)] = "lm_head"
    cpu, flags = cpu_identity()
    print(
        f"CPU: {cpu} (native bf16: {native_bf16()}); torch {torch.__version__}; "
        f"{torch.get_num_threads()} threads"
    )
    record: dict[str, object] = {
        "benchmark": "kernels",
        "cpu": cpu,
        "threads": args.threads,
        "dtypes": {},
    }
    totals: dict[str, float] = {}
    sels: dict[str, Selection] = {}
    for name in args.dtype:
        sel = sels[name] = select_shapes(args.device, arch, DTYPES[name], "measure")
        print(f"\n== {name}: {sel.summary()}")
        print("\n".join(table(sel, names) + check_lines(sel, names)))
        totals[name] = decode_matmul_seconds(sel, arch)
        record["dtypes"][name] = {  # type: ignore[index]
            "summary": sel.summary(),
            "timings": [
                t.__dict__ | {"gbytes_per_s": t.gbytes_per_s, "gflops": t.gflops}
                for t in sel.timings
            ],
            "decode_matmul_seconds_m1_8_32": totals[name],
            "step_checks": sel.checks,
        }
        if sel.skipped:
            print("skipped: " + "; ".join(f"{k}: {v}" for k, v in sel.skipped.items()))
    print()
    for name, total in totals.items():
        print(f"decode matmuls (M=1+8+32, chosen kernels), {name}: {total * 1e3:.2f} ms")
    if {"float32", "bfloat16"} <= set(sels):
        # NOTE: the start-up rule itself (matmuls and decode attention, in alternation).
        ratio = dtype_speedup(
            arch,
            sels["float32"],
            sels["bfloat16"],
            device=torch.device(args.device),
            mode="measure",
        )
        pick = "bfloat16" if native_bf16() and ratio > 1.0 else "float32"
        print(
            f"--dtype auto would choose {pick} (decode matmuls + attention: bf16 {ratio:.2f}x "
            "fp32 speed; dense weights: a model whose weights load quantized is weighed on its "
            "quantized projections at load)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2, default=str)


if __name__ == "__main__":
    main()
