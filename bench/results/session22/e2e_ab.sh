#!/usr/bin/env bash
# End-to-end A/B of a session 22 change: "old" = commit BASE from a git worktree, "new" = the
# checked-out tree, each with its own KVSERVE_CACHE_DIR, alternated ROUNDS times: bare decode
# at BATCHES (runtime_speed), then uniform 128+128 at B=32 and the ShareGPT-like 64 @ 32 end
# to end (session 20's workload files); records under bench/results/session22/ab/PREFIX*
# (or $AB_OUT).
#   the greedy logits path:  bench/results/session22/e2e_ab.sh 2cdcb4a 2 "" 32 > bench/results/session22/logits_ab.txt
#   the line stream:         bench/results/session22/e2e_ab.sh b66c10f 2 attn_ "8 32" > bench/results/session22/attn_stream_ab.txt
set -euo pipefail
cd "$(dirname "$0")/../../.."
BASE=${1:?BASE}; ROUNDS=${2:-2}; PREFIX=${3:-}; BATCHES=${4:-32}
. bench/ab_tree.sh
OLD=$(ab_worktree "$BASE")
OUT=${AB_OUT:-bench/results/session22/ab}  # another session's A/B names its own
mkdir -p "$OUT"
lscpu | grep -E "Model name|Flags"
side() {  # tag tree round
  # shellcheck disable=SC2086
  in_tree "$2" "$AB_PY" -m kvserve.bench.runtime_speed --batch-sizes $BATCHES --steps 64 \
    --repeats 3 --threads 2 2>&1 | grep -E "^B=|^dtype"
  ab_throughput "$1" "$2" bench/results/session20/final/uniform/workload_128x128.jsonl 32 32 \
    "$OUT/${PREFIX}uniform_$1_$3.json"
  ab_throughput "$1" "$2" bench/results/session20/final/sharegpt/workload_sharegpt_64.jsonl 64 32 \
    "$OUT/${PREFIX}sharegpt_$1_$3.json"
}
ab_rounds "$ROUNDS" "$OLD" side
