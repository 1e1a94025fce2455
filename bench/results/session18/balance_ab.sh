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
. bench/ab_tree.sh
OLD=$(ab_worktree "$BASE")
W=bench/results/session17/throughput_ab
run() {  # tag tree workload num_prompts max_num_seqs
  ab_throughput "$1" "$2" "$3" "$4" "$5" "$OUT/${1}_$(basename "$3" .jsonl)_b$5_r$i${SUFFIX:-}.json"
}
for i in $(seq "$ROUNDS"); do
  for tag in old new; do
    tree=$([ $tag = old ] && echo "$OLD" || echo "$PWD")
    run $tag "$tree" "$W/workload_sharegpt_64.jsonl" 64 32
    [ "${SHAREGPT_ONLY:-0}" = 1 ] || run $tag "$tree" "$W/workload_128x128.jsonl" 32 32
  done
done
