"""Turn one sitting's raw output (``bench/run_sitting.sh OUT``) into a record.

    python3 bench/make_record.py OUT [--cpu-kind KIND] [--commit SHA] [--command CMD]
        [--records bench/records] [--note TEXT]

Reads OUT/{uniform,sharegpt,served,llama}/ (the JSON records the sitting wrote, its
``versions.txt`` and ``llama/runtime_speed_default.txt``), OUT/lscpu.txt and OUT/commit.txt
(written by run_sitting.sh), and writes ``bench/records/<cpu-kind>/<date>_<commit>.json``:
the figures, the CPU's model and relevant flags, the peers' versions and the commands. The
schema is in bench/records/README.md. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

RELEVANT_FLAGS = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
)  # fmt: skip
PHASES = {  # folder -> (trace, what it measures)
    "uniform": "uniform 128+128 prompts, 32 of them, offline at B=1/8/32",
    "sharegpt": "ShareGPT-like trace, 64 requests, 32 in flight, offline",
    "served": "the ShareGPT-like trace through each server, 32 in flight",
    "llama": "llama.cpp's batched-bench on the uniform trace; kvserve's bare decode",
}  # the folders run_sitting.sh writes (sittings before 2026-12-02 15:00 UTC: OUT_uniform, ...)
SITTING_COMMANDS = [
    "kvserve bench workload --input-len 128 --output-len 128 --num-prompts 32 "
    "--vocab-size 49152 --save-workload OUT/uniform/workload_128x128.jsonl",
    "kvserve bench throughput --workload-file OUT/uniform/workload_128x128.jsonl "
    "--num-prompts B --max-num-seqs B --num-threads 2 "
    "--output-json OUT/uniform/offline_kvserve_{before,default}_bB.json",
    "SYSTEMS=vllm MODES=offline VLLM_DTYPES=... bench/run_side_by_side.sh OUT/uniform",
    "kvserve bench workload --workload sharegpt --max-output-len 512 --num-prompts 64 "
    "--vocab-size 49152 --save-workload OUT/sharegpt/workload_sharegpt_64.jsonl",
    "kvserve bench throughput --workload-file OUT/sharegpt/workload_sharegpt_64.jsonl "
    "--num-prompts 64 --max-num-seqs 32 --num-threads 2",
    "WORKLOAD=sharegpt BATCH_SIZES=32 NUM_PROMPTS=64 MAX_OUTPUT_LEN=512 SYSTEMS=vllm "
    "MODES=offline bench/run_side_by_side.sh OUT/sharegpt",
    "WORKLOAD=sharegpt BATCH_SIZES=32 NUM_PROMPTS=64 MAX_OUTPUT_LEN=512 "
    'SYSTEMS="kvserve vllm" MODES=server bench/run_side_by_side.sh OUT/served',
    "SYSTEMS=llama.cpp MODES=offline bench/run_side_by_side.sh OUT/llama",
    "python -m kvserve.bench.runtime_speed --batch-sizes 1 8 32 --steps 64 --prompt-len 128 "
    "--threads 2 --repeats 3 --floor",
]


def cpu_kind(model: str, flags: set[str]) -> str:
    """The short machine-kind name records are filed under."""
    vendor = "epyc" if "AMD" in model or "EPYC" in model else "xeon"
    if "amx_bf16" in flags:
        return f"{vendor}-amx"
    if "avx512f" in flags:
        return f"{vendor}-avx512"
    return f"{vendor}-avx2" if "avx2" in flags else vendor


def parse_lscpu(text: str) -> dict:
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if value:
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("Flags", "").split())
    out = {
        "model": fields.get("Model name", ""),
        "flags": [f for f in RELEVANT_FLAGS if f in flags],
    }
    for key, name in (("CPU(s)", "cpus"), ("L3 cache", "l3"), ("CPU family", "family"),
                      ("Model", "model_number")):  # fmt: skip
        if key in fields:
            out[name] = fields[key]
    return out, flags


def parse_versions(text: str) -> dict:
    info = {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name in ("kvserve", "vllm", "llama.cpp"):
            info[name] = rest.strip()
        elif name == "date":
            info["date"] = rest.strip()
        elif line.startswith("host "):
            info["host"] = line[5:].strip()
        elif line.startswith("load at start:"):
            info["load_at_start"] = line.split(":", 1)[1].strip()
    return info


def _tps(rec: dict) -> float:
    return round(rec["results"]["output_tokens_per_s"], 1)


def phase_figures(folder: Path) -> dict:
    """Per batch size, per system: output tok/s (servers: with TTFT and ITL medians)."""
    figs: dict[str, dict] = {}
    for f in sorted(folder.glob("*.json")):
        m = re.fullmatch(r"(offline|server)_(.+)_b(\d+)(_after)?\.json", f.name)
        if not m:
            continue
        rec = json.loads(f.read_text())
        system = re.sub(r"^vllm_", "vllm-", m.group(2)) + (m.group(4) or "")
        row = figs.setdefault(f"B={m.group(3)}", {})
        if m.group(1) == "server":
            r = rec["results"]
            row[system] = {
                "tok_s": _tps(rec),
                "ttft_median_ms": round(r["ttft"]["median"] * 1e3, 1),
                "itl_median_ms": round(r["itl"]["median"] * 1e3, 1),
            }
        else:
            row[system] = _tps(rec)
            dec = rec["results"].get("decode_tokens_per_s")
            if dec is not None:
                row[system + "_decode_only"] = round(dec, 1)
    return dict(sorted(figs.items(), key=lambda kv: int(kv[0][2:])))


def parse_runtime_speed(text: str) -> dict:
    out: dict = {}
    b = None
    for line in text.splitlines():
        if line.startswith("dtype "):
            out["dtype_and_kernels"] = line.strip()
        if m := re.search(r"step ([\d.]+) MB; read bandwidth ([\d.]+) GB/s", line):
            out["weights_mb_per_step"] = float(m.group(1))
            out["read_gb_s"] = float(m.group(2))
        if m := re.match(r"B=\s*(\d+)\s+prefill\s+([\d.]+) tok/s\s+decode\s+([\d.]+) tok/s", line):
            b = f"B={m.group(1)}"
            out[b] = {"prefill_tok_s": float(m.group(2)), "decode_tok_s": float(m.group(3))}
            if p := re.search(r"= (\d+) % of the bandwidth bound", line):
                out[b]["pct_of_bound"] = int(p.group(1))
        elif b and (m := re.search(r"matmuls alone\s+([\d.]+) tok/s", line)):
            out[b]["matmuls_alone_tok_s"] = float(m.group(1))
            if s := re.search(r"decode step = ([\d.]+) x", line):
                out[b]["step_over_matmuls"] = float(s.group(1))
    return out


def alternate_figures(folder: Path) -> dict:
    """bench/run_alternate.sh's runs, in order: kvserve and vLLM alternated at B=32."""
    out: dict = {}
    for trace in ("uniform", "sharegpt"):
        kv = sorted(folder.glob(f"kv_{trace}_*.json"), key=lambda f: int(f.stem.rsplit("_", 1)[1]))
        vl = sorted(
            folder.glob(f"vllm_{trace}_*/offline_vllm_*_b32.json"),
            key=lambda f: int(f.parent.name.rsplit("_", 1)[1]),
        )
        if kv:
            out[f"{trace} B=32"] = {"kvserve": [_tps(json.loads(f.read_text())) for f in kv]}
            out[f"{trace} B=32"]["vllm-bf16"] = [_tps(json.loads(f.read_text())) for f in vl]
    return out


def ratios(figures: dict) -> dict:
    """kvserve's output tok/s over vLLM's best dtype, per row (lowest and highest run)."""
    out = {}
    for phase in ("uniform", "sharegpt", "served"):
        for b, row in figures.get(phase, {}).items():
            val = {k: (v["tok_s"] if isinstance(v, dict) else v) for k, v in row.items()}
            kv = [v for k, v in val.items() if k.startswith("kvserve")]
            vl = [v for k, v in val.items() if k.startswith("vllm")]
            if kv and vl and max(vl) > 0:
                lo, hi = min(kv) / max(vl), max(kv) / max(vl)
                out[f"{phase} {b}"] = [round(lo, 2), round(hi, 2)]
    return out


def build(out_dir: Path, args: argparse.Namespace) -> dict:
    def phase_dir(name: str) -> Path:
        inner = out_dir / name
        return inner if inner.is_dir() else out_dir.parent / f"{out_dir.name}_{name}"

    versions = {}
    for name in PHASES:
        v = phase_dir(name) / "versions.txt"
        if v.is_file():
            for k, val in parse_versions(v.read_text()).items():
                versions.setdefault(k, val)
    if not versions:
        sys.exit(f"{out_dir}: no versions.txt under uniform/, sharegpt/, served/ or llama/")
    cpu_txt = next(
        (
            p
            for p in (args.cpu_txt, out_dir / "lscpu.txt", Path(f"{out_dir}.cpu.txt"))
            if p and Path(p).is_file()
        ),
        None,
    )
    text = (
        Path(cpu_txt).read_text()
        if cpu_txt
        else (phase_dir("uniform") / "versions.txt").read_text()
    )
    lscpu, flags = parse_lscpu(text)
    commit, dirty = args.commit, False
    if not commit and (out_dir / "commit.txt").is_file():
        commit, *rest = (out_dir / "commit.txt").read_text().split()
        dirty = "dirty" in rest
    if not commit:
        sys.exit("no commit: pass --commit or run the sitting through bench/run_sitting.sh")
    command = args.command
    if not command and (out_dir / "command.txt").is_file():
        command = (out_dir / "command.txt").read_text().strip()
    figures: dict = {}
    for name in ("uniform", "sharegpt", "served", "llama"):
        if phase_dir(name).is_dir():
            figures[name] = phase_figures(phase_dir(name))
    alt = args.alternate or out_dir / "alternate"
    if Path(alt).is_dir() and (found := alternate_figures(Path(alt))):
        figures["alternate"] = found
    speed = phase_dir("llama") / "runtime_speed_default.txt"
    if speed.is_file():
        figures["bare_decode"] = parse_runtime_speed(speed.read_text())
    date = versions["date"][:10]
    peers = {k: versions[k] for k in ("kvserve", "vllm", "llama.cpp") if k in versions}
    record = {
        "cpu_kind": args.cpu_kind or cpu_kind(lscpu["model"], flags),
        "date": date,
        "commit": commit[:7],
        "started_utc": versions["date"],
        "host": versions.get("host", ""),
        "load_at_start": versions.get("load_at_start", ""),
        "lscpu": lscpu,
        "peers": peers,
        "commands": [command or "bench/run_sitting.sh OUT"] + SITTING_COMMANDS,
        "figures": figures,
        "ratios_vs_best_vllm": ratios(figures),
    }
    if dirty:
        record["worktree_dirty"] = True
    if args.note:
        record["note"] = args.note
    return record


def dumps(record: dict) -> str:
    """Indented JSON with lists of scalars kept on one line (small, diffable records)."""
    text = json.dumps(record, indent=1)
    flat = re.compile(r"\[\n\s*((?:[^\[\]{}\n]+,\n\s*)*[^\[\]{}\n]+)\n\s*\]")
    return flat.sub(lambda m: "[" + re.sub(r",\n\s*", ", ", m.group(1)) + "]", text) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path, help="the sitting's OUT_DIR (bench/run_sitting.sh)")
    p.add_argument("--cpu-kind", help="default: from lscpu (xeon-amx, epyc-avx512, ...)")
    p.add_argument("--commit", help="default: OUT/commit.txt")
    p.add_argument("--command", help="default: OUT/command.txt")
    p.add_argument("--cpu-txt", help="lscpu output; default OUT/lscpu.txt")
    p.add_argument(
        "--alternate", type=Path, help="bench/run_alternate.sh's OUT_DIR; default OUT/alternate"
    )
    p.add_argument("--note", help="one line kept with the record")
    p.add_argument("--records", type=Path, default=Path(__file__).parent / "records")
    p.add_argument("--stdout", action="store_true", help="print instead of writing")
    args = p.parse_args(argv)
    record = build(args.out_dir, args)
    text = dumps(record)
    if args.stdout:
        print(text, end="")
        return 0
    path = args.records / record["cpu_kind"] / f"{record['date']}_{record['commit']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file():  # another sitting at the same commit on the same date: a repeat
        first = json.loads(path.read_text())
        repeats = first.setdefault("repeats", [])
        if record["started_utc"] != first["started_utc"] and all(
            r.get("started_utc") != record["started_utc"] for r in repeats
        ):
            keep = ("started_utc", "load_at_start", "figures", "ratios_vs_best_vllm")
            repeats.append({k: record[k] for k in keep if k in record})
        text = dumps(first)
    path.write_text(text)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
