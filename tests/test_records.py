"""bench/records: one small JSON record per sitting, named <cpu-kind>/<date>_<commit>.json.

The schema is described in bench/records/README.md; this checks every record against it and
keeps the whole folder under its 5 MiB budget.
"""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

import pytest

RECORDS = Path(__file__).resolve().parents[1] / "bench" / "records"
RECORD_FILES = sorted(RECORDS.glob("**/*.json"))
MAX_BYTES = 5 * 1024 * 1024
KINDS = re.compile(r"(xeon|epyc)(-[a-z0-9]+)+")
TOP_KEYS = {
    "cpu_kind": str,
    "date": str,
    "commit": str,
    "lscpu": dict,
    "peers": dict,
    "commands": list,
    "figures": dict,
}


def test_there_are_records():
    assert RECORD_FILES, f"no records under {RECORDS}"
    assert (RECORDS / "README.md").is_file()


def test_records_stay_small():
    total = sum(p.stat().st_size for p in RECORDS.rglob("*") if p.is_file())
    assert total <= MAX_BYTES, f"bench/records holds {total} bytes, over {MAX_BYTES}"


def test_only_json_records_and_the_readme():
    others = [
        p
        for p in RECORDS.rglob("*")
        if p.is_file() and p.suffix != ".json" and p != RECORDS / "README.md"
    ]
    assert not others, f"raw dumps belong in bench/out/ (ignored), not in records: {others}"


@pytest.mark.parametrize(
    "path", RECORD_FILES, ids=[str(p.relative_to(RECORDS)) for p in RECORD_FILES]
)
def test_record(path: Path):
    record = json.loads(path.read_text())
    for key, kind in TOP_KEYS.items():
        assert isinstance(record.get(key), kind), f"{key} missing or not a {kind.__name__}"
    assert KINDS.fullmatch(record["cpu_kind"]), record["cpu_kind"]
    assert path.parent.parent == RECORDS and path.parent.name == record["cpu_kind"]
    datetime.date.fromisoformat(record["date"])
    assert re.fullmatch(r"[0-9a-f]{7,12}", record["commit"])
    # NOTE: a per-family speed sitting (bench/peers/family_speed.py) and a speculative
    # decoding sitting (`kvserve bench spec`) file their own records.
    stem = f"{record['date']}_{record['commit']}"
    assert path.name in (f"{stem}.json", f"{stem}_families.json", f"{stem}_spec.json")
    lscpu = record["lscpu"]
    assert isinstance(lscpu.get("model"), str) and lscpu["model"]
    assert isinstance(lscpu.get("flags"), list) and all(isinstance(f, str) for f in lscpu["flags"])
    assert record["peers"] and all(isinstance(v, str) and v for v in record["peers"].values())
    assert record["commands"] and all(isinstance(c, str) and c for c in record["commands"])
    assert record["figures"], "a record holds figures"
    # The kind follows from the flags: AMX tiles, else AVX-512, else AVX2.
    flags = set(lscpu["flags"])
    if record["cpu_kind"].endswith("-amx"):
        assert "amx_bf16" in flags
    elif record["cpu_kind"].endswith("-avx512"):
        assert "avx512f" in flags and "amx_bf16" not in flags
    elif record["cpu_kind"].endswith("-avx2"):
        assert "avx2" in flags and "avx512f" not in flags
    for repeat in record.get("repeats", []):
        assert isinstance(repeat.get("figures"), dict) and repeat["figures"]
