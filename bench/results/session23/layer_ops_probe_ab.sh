#!/usr/bin/env bash
# The per-layer ops hot (bench/probes/layer_ops_hot.py, this tree's copy run on each side's
# code), commit BASE (a git worktree) against the checked-out tree, alternated ROUNDS times.
#   bench/results/session23/layer_ops_probe_ab.sh [BASE=644e79f] [ROUNDS=2] > bench/results/session23/layer_ops_probe_ab.txt
set -euo pipefail
cd "$(dirname "$0")/../../.."
BASE=${1:-644e79f}; ROUNDS=${2:-2}
. bench/ab_tree.sh
OLD=$(ab_worktree "$BASE")
lscpu | grep -E "Model name|Flags"
side() {  # tag tree round
  in_tree "$2" "$AB_PY" "$AB_ROOT/bench/probes/layer_ops_hot.py" 2>&1 | grep threads
}
ab_rounds "$ROUNDS" "$OLD" side
