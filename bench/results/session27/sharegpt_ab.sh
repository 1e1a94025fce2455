#!/usr/bin/env bash
# ShareGPT-like 64 @ 32 end to end, "old" = commit 0948bdf (session 26's last) from a git
# worktree against the checked-out tree, alternated 3 times, each with its own
# KVSERVE_CACHE_DIR (bench/ab_tree.sh): did this session's changes slow kvserve down?
#   bench/results/session27/sharegpt_ab.sh > bench/results/session27/sharegpt_ab.txt
set -euo pipefail
cd "$(dirname "$0")/../../.."
. bench/ab_tree.sh
OLD=$(ab_worktree 0948bdf)
OUT=bench/results/session27/sharegpt_ab; mkdir -p "$OUT"
side() {  # tag tree round
  ab_throughput "$1" "$2" bench/results/session27/sitting/sharegpt/workload_sharegpt_64.jsonl \
    64 32 "$OUT/sharegpt_$1_$3.json"
}
ab_rounds 3 "$OLD" side
