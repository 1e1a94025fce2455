#!/usr/bin/env bash
# The fused decode call taking the dense copies of quantized weights and AMX bf16 dense
# weights (part kind 5): "old" = commit c933abc (session 28's last) against the checked-out
# tree, uniform 128+128 at B=32 and ShareGPT-like 64 @ 32, alternated 3 times (bench/ab_tree.sh).
#   bench/results/session29/fuse_copies_ab.sh > bench/results/session29/fuse_copies_ab.txt
set -euo pipefail
cd "$(dirname "$0")/../../.."
. bench/ab_tree.sh
OLD=$(ab_worktree c933abc)
S=bench/results/session28/sitting
OUT=bench/results/session29/fuse_copies_ab; mkdir -p "$OUT"
side() {  # tag tree round
  ab_throughput "$1" "$2" "$S/uniform/workload_128x128.jsonl" 32 32 "$OUT/uniform_$1_$3.json"
  ab_throughput "$1" "$2" "$S/sharegpt/workload_sharegpt_64.jsonl" 64 32 "$OUT/sharegpt_$1_$3.json"
}
ab_rounds 3 "$OLD" side
