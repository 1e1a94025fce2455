#!/usr/bin/env bash
# Offline e2e A/B of the decode attention's thread split: the tree as checked out ("new":
# threads take contiguous tasks of equal positions) against commit BASE ("old": equal task
# counts), run from a git worktree of BASE with the same venv; ShareGPT-like 64 requests at
# 32 in flight and (unless SHAREGPT_ONLY=1) uniform 128+128 at B=32 (equal lengths: a
# control), alternated ROUNDS times.
#   [SHAREGPT_ONLY=1] bench/results/session18/balance_ab.sh [BASE=8b3f4a5] [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/../../.."
BASE=${1:-8b3f4a5}; ROUNDS=${2:-3}
OUT=bench/results/session18/balance_ab; mkdir -p "$OUT"
OLD=/tmp/kvserve-base-$BASE
[ -d "$OLD" ] || git worktree add --detach "$OLD" "$BASE" > /dev/null
W=bench/results/session17/throughput_ab
run() {  # tag tree workload num_prompts max_num_seqs
  local j="$PWD/$OUT/${1}_$(basename "$3" .jsonl)_b$5_r$i${SUFFIX:-}.json"
  # NOTE: run from the tree itself: python -m puts the working directory ahead of PYTHONPATH
  # (until session 20 this ran from the checked-out tree, so both sides ran the new code).
  (cd "$2" && PYTHONPATH="$2" "$OLDPWD/.venv/bin/python" -m kvserve.cli bench throughput \
    --workload-file "$OLDPWD/$3" --num-prompts "$4" --max-num-seqs "$5" --num-threads 2 \
    --output-json "$j") > /dev/null 2>&1
  echo "$(date -u +%H:%M:%S) $1 $(basename "$3") B=$5: $(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['results']['output_tokens_per_s'], 1))" "$j") tok/s"
}
for i in $(seq "$ROUNDS"); do
  for tag in old new; do
    tree=$([ $tag = old ] && echo "$OLD" || echo "$PWD")
    run $tag "$tree" "$W/workload_sharegpt_64.jsonl" 64 32
    [ "${SHAREGPT_ONLY:-0}" = 1 ] || run $tag "$tree" "$W/workload_128x128.jsonl" 32 32
  done
done
