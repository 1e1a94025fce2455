#!/usr/bin/env bash
# Bare-decode A/B of the kernel selection's 9-16 row bucket (kvserve/runtime/kernel_select.py,
# DECODE_BOUNDS): "old" = commit BASE (buckets 1, 8, 32, 128) from a git worktree with the same
# venv, "new" = the checked-out tree (1, 8, 16, 32, 128); each with its own KVSERVE_CACHE_DIR
# so that each measures and keeps its own selection; alternated ROUNDS times.
#   bench/results/session20/bucket16_ab.sh [BASE=545a8d6] [ROUNDS=2] > bench/results/session20/bucket16_ab.txt
set -euo pipefail
cd "$(dirname "$0")/../../.."
BASE=${1:-545a8d6}; ROUNDS=${2:-2}
. bench/ab_tree.sh
OLD=$(ab_worktree "$BASE")
lscpu | grep -E "Model name|Flags"
for tag in old new; do
  mkdir -p "/tmp/kvserve-ab-cache-$tag"
  cp -r ~/.cache/kvserve/native "/tmp/kvserve-ab-cache-$tag/" 2>/dev/null || true
done
for i in $(seq "$ROUNDS"); do
  for tag in old new; do
    tree=$([ $tag = old ] && echo "$OLD" || echo "$PWD")
    echo "== $tag round $i $(date -u +%H:%M:%S): $(in_tree "$tree" "$AB_PY" -c \
      'import kvserve.runtime.kernel_select as k; print(k.__file__, k.DECODE_BOUNDS)')"
    KVSERVE_CACHE_DIR="/tmp/kvserve-ab-cache-$tag" in_tree "$tree" "$AB_PY" \
      -m kvserve.bench.runtime_speed --batch-sizes 8 12 16 24 32 --steps 64 --repeats 3 \
      --threads 2 2>&1 | grep "^B="
  done
done
