#!/usr/bin/env bash
# A/B of session 22's decode attention line stream (kvserve/runtime/native/kvserve_cpu_ops.cpp:
# LineStream, the K and V lines prefetched a few at a time from inside the kernels' loops):
# "old" = commit BASE from a git worktree, "new" = the checked-out tree, each with its own
# KVSERVE_CACHE_DIR, alternated ROUNDS times: bare decode at B=8 and 32 (runtime_speed), then
# uniform 128+128 at B=32 and the ShareGPT-like 64 @ 32 end to end (session 20's workloads).
#   bench/results/session22/attn_stream_ab.sh [BASE=b66c10f] [ROUNDS=2] > bench/results/session22/attn_stream_ab.txt
set -euo pipefail
cd "$(dirname "$0")/../../.."
BASE=${1:-b66c10f}; ROUNDS=${2:-2}
. bench/ab_tree.sh
OLD=$(ab_worktree "$BASE")
OUT=bench/results/session22/ab
mkdir -p "$OUT"
lscpu | grep -E "Model name|Flags"
for tag in old new; do mkdir -p "/tmp/kvserve-ab-cache-$tag"; done
for i in $(seq "$ROUNDS"); do
  for tag in old new; do
    tree=$([ $tag = old ] && echo "$OLD" || echo "$PWD")
    export KVSERVE_CACHE_DIR="/tmp/kvserve-ab-cache-$tag"
    echo "== $tag round $i $(date -u +%H:%M:%S) ($tree)"
    in_tree "$tree" "$AB_PY" -m kvserve.bench.runtime_speed --batch-sizes 8 32 --steps 64 \
      --repeats 3 --threads 2 2>&1 | grep -E "^B="
    ab_throughput "$tag" "$tree" bench/results/session20/final/uniform/workload_128x128.jsonl 32 32 \
      "$OUT/attn_uniform_${tag}_$i.json"
    ab_throughput "$tag" "$tree" bench/results/session20/final/sharegpt/workload_sharegpt_64.jsonl 64 32 \
      "$OUT/attn_sharegpt_${tag}_$i.json"
  done
done
