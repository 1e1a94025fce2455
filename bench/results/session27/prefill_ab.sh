#!/usr/bin/env bash
# End-to-end A/B of session 27's AMX prefill attention: "old" = commit BASE from a git worktree,
# "new" = the checked-out tree, each with its own KVSERVE_CACHE_DIR, alternated ROUNDS times:
# the ShareGPT-like 64 @ 32 and uniform 128+128 at B=32 end to end (session 26's workload
# files), and 8 long prompts (1920 tokens in, 16 out, 8 in flight: prefill-bound); records under
# bench/results/session27/ab/ (or $AB_OUT).
#   bench/results/session27/prefill_ab.sh 0948bdf 2 > bench/results/session27/prefill_ab.txt
set -euo pipefail
cd "$(dirname "$0")/../../.."
BASE=${1:?BASE}; ROUNDS=${2:-2}
. bench/ab_tree.sh
OLD=$(ab_worktree "$BASE")
OUT=${AB_OUT:-bench/results/session27/ab}
mkdir -p "$OUT"
LONG="$OUT/workload_long_1920x16.jsonl"
[ -f "$LONG" ] || .venv/bin/kvserve bench workload --input-len 1920 --output-len 16 \
  --num-prompts 8 --vocab-size 49152 --save-workload "$LONG" > /dev/null
lscpu | grep -E "Model name|Flags"
side() {  # tag tree round
  ab_throughput "$1" "$2" bench/results/session26/sitting/uniform/workload_128x128.jsonl 32 32 \
    "$OUT/uniform_$1_$3.json"
  ab_throughput "$1" "$2" bench/results/session26/sitting/sharegpt/workload_sharegpt_64.jsonl 64 32 \
    "$OUT/sharegpt_$1_$3.json"
  ab_throughput "$1" "$2" "$LONG" 8 8 "$OUT/long_$1_$3.json"
  "$AB_PY" -c "import json,sys; r=json.load(open(sys.argv[1]))['results']; print('   long: TTFT median', round(r['ttft']['median']*1e3), 'ms, e2e', round(r['elapsed_s'], 2), 's')" "$OUT/long_$1_$3.json"
}
ab_rounds "$ROUNDS" "$OLD" side
