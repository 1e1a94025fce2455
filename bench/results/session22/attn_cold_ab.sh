#!/usr/bin/env bash
# Decode attention on cold K/V (bench/probes/attn_cold.py), commit BASE (a git worktree)
# against the checked-out tree, alternated ROUNDS times: B=32 at 192 and 464 tokens, B=8 at
# 192, two threads, the caches in huge pages (as the engine's KV pool).
#   bench/results/session22/attn_cold_ab.sh [BASE=b66c10f] [ROUNDS=2] > bench/results/session22/attn_cold_ab.txt
set -euo pipefail
cd "$(dirname "$0")/../../.."
BASE=${1:-b66c10f}; ROUNDS=${2:-2}
. bench/ab_tree.sh
OLD=$(ab_worktree "$BASE")
lscpu | grep -E "Model name|Flags"
side() {  # tag tree round
  for shape in "--len 192" "--len 464" "--len 192 --batch 8"; do
    # shellcheck disable=SC2086
    echo "$shape: $(in_tree "$2" "$AB_PY" bench/probes/attn_cold.py --huge-pages --threads 2 $shape 2>&1 | grep random)"
  done
}
ab_rounds "$ROUNDS" "$OLD" side
