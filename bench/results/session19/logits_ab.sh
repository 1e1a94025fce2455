#!/usr/bin/env bash
# Offline e2e A/B of a change tried and not kept (logits_ab.patch beside this script): the
# sampler took the lm_head's bf16 logits as they are (an all-greedy batch's argmax with no
# float32 copy). "new" = the checked-out tree with the patch applied (`git apply`), "old" =
# commit BASE from a git worktree with the same venv; alternated ROUNDS times on this
# session's sitting traces, uniform 128+128 at B=32 and ShareGPT-like 64 @ 32.
#   git apply bench/results/session19/logits_ab.patch
#   [OUT=DIR] bench/results/session19/logits_ab.sh [BASE=063d257] [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/../../.."
BASE=${1:-063d257}; ROUNDS=${2:-3}
OUT=${OUT:-bench/results/session19/logits_ab}; mkdir -p "$OUT"
. bench/ab_tree.sh
OLD=$(ab_worktree "$BASE")
W=bench/results/session19/final
run() {  # tag tree workload num_prompts max_num_seqs
  ab_throughput "$1" "$2" "$3" "$4" "$5" "$OUT/${1}_$(basename "$3" .jsonl)_b$5_r$i.json"
}
for i in $(seq "$ROUNDS"); do
  for tag in old new; do
    tree=$([ $tag = old ] && echo "$OLD" || echo "$PWD")
    run $tag "$tree" "$W/uniform/workload_128x128.jsonl" 32 32
    run $tag "$tree" "$W/sharegpt/workload_sharegpt_64.jsonl" 64 32
  done
done
