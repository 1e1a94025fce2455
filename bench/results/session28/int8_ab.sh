#!/usr/bin/env bash
# Uniform 128+128 at B=32 and ShareGPT-like 64 @ 32 end to end, "old" = commit 63fb95e
# (session 27's last) from a git worktree against the checked-out tree (int8 on AMX tiles),
# alternated 3 times, each side with its own KVSERVE_CACHE_DIR (bench/ab_tree.sh).
#   bench/results/session28/int8_ab.sh > bench/results/session28/int8_ab.txt
set -euo pipefail
cd "$(dirname "$0")/../../.."
. bench/ab_tree.sh
OLD=$(ab_worktree 63fb95e)
OUT=bench/results/session28/int8_ab; mkdir -p "$OUT"
side() {  # tag tree round
  ab_throughput "$1" "$2" bench/results/session28/sitting/uniform/workload_128x128.jsonl \
    32 32 "$OUT/uniform_$1_$3.json"
  ab_throughput "$1" "$2" bench/results/session28/sitting/sharegpt/workload_sharegpt_64.jsonl \
    64 32 "$OUT/sharegpt_$1_$3.json"
}
ab_rounds 3 "$OLD" side
