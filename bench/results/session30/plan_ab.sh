#!/usr/bin/env bash
# Whole decode steps at B=32 under two plans for the 17-32-row bucket of the embedded GGUF
# (bf16, AMX Xeon): A = $A (default q4_1_x16_amx_bf16, the Q4_1 blocks in AMX tiles; "measured":
# the plan the selection takes) for the four layer shapes, B = int8_amx (the int8 copies);
# everything else as measured. One measurement is copied into two cache directories and
# edited; the 17-32-row plans are printed (since plan_ab_final.sh), then runtime_speed
# alternates A and B.
#   bash bench/results/session30/plan_ab.sh [ROUNDS] > bench/results/session30/plan_ab.txt
set -euo pipefail
cd "$(dirname "$0")/../../.."
ROUNDS=${1:-4}
A=${A:-q4_1_x16_amx_bf16}
BASE=$(mktemp -d)
cp -r "${KVSERVE_CACHE_DIR:-$HOME/.cache/kvserve}/native" "$BASE/" 2>/dev/null || true
KVSERVE_CACHE_DIR=$BASE .venv/bin/python -m kvserve.bench.runtime_speed --batch-sizes 1 \
  --steps 4 --prompt-len 16 --threads 2 >/dev/null
for p in A B; do rm -rf "$BASE.$p"; cp -r "$BASE" "$BASE.$p"; done
edit() {  # $1: cache dir, $2: the 17-32 method for the layer shapes
  .venv/bin/python - "$1" "$2" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/kernel_select/*.json"):
    r = json.load(open(f))
    if r["key"].get("dtype") != "bf16" or "quant_candidates" not in r["key"]:
        continue
    for o, i, choice in r["plan"]:
        for c in choice:
            if c[0] == 32 and o != 49152:
                c[1] = sys.argv[2]
    json.dump(r, open(f, "w"))
PY
}
[ "$A" = measured ] || edit "$BASE.A" "$A"
edit "$BASE.B" int8_amx
echo "# $(date -u +%FT%TZ) $(git rev-parse --short HEAD); $(lscpu | grep 'Model name' | sed 's/  */ /g')"
for p in A B; do
  .venv/bin/python - "$BASE.$p" "$p" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/kernel_select/*.json"):
    r = json.load(open(f))
    if r["key"].get("dtype") == "bf16" and "quant_candidates" in r["key"]:
        at32 = {f"{o}x{i}": dict(map(tuple, c))[32] for o, i, c in r["plan"]}
        print(f"# plan {sys.argv[2]} at 17-32 rows: {at32}")
PY
done
for r in $(seq "$ROUNDS"); do
  for p in A B; do
    echo -n "$p "
    KVSERVE_CACHE_DIR=$BASE.$p .venv/bin/python -m kvserve.bench.runtime_speed --batch-sizes 32 \
      --steps 64 --prompt-len 128 --threads 2 --repeats 3 | grep -o "B= 32.*median of 3 [0-9.]*"
  done
done
rm -rf "$BASE" "$BASE.A" "$BASE.B"
