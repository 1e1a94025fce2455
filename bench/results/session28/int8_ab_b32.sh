#!/usr/bin/env bash
# Uniform 128+128 at B=32 only, "old" = commit 63fb95e (session 27's last) against the
# checked-out tree, alternated 5 times (bench/ab_tree.sh): does the int8 path lose in the
# host's slow minutes (it reads 1.7x Q4_1's bytes)?
#   bench/results/session28/int8_ab_b32.sh > bench/results/session28/int8_ab_b32.txt
set -euo pipefail
cd "$(dirname "$0")/../../.."
. bench/ab_tree.sh
OLD=$(ab_worktree 63fb95e)
OUT=bench/results/session28/int8_ab_b32; mkdir -p "$OUT"
side() {  # tag tree round
  ab_throughput "$1" "$2" bench/results/session28/sitting/uniform/workload_128x128.jsonl \
    32 32 "$OUT/uniform_$1_$3.json"
}
ab_rounds 5 "$OLD" side
