#!/usr/bin/env bash
# Session 22's end-to-end A/B (bench/results/session22/e2e_ab.sh BASE ROUNDS PREFIX BATCHES),
# its records under bench/results/session23/ab:
#   the layer ops (rms_row_wide, vcvtneps2bf16, vscalefps exp):
#     bench/results/session23/e2e_ab.sh 644e79f 2 ops_ 32 > bench/results/session23/layer_ops_ab.txt
#     bench/results/session23/e2e_ab.sh 644e79f 2 ops2_ 32 > bench/results/session23/layer_ops_ab2.txt
set -euo pipefail
cd "$(dirname "$0")/../../.."
AB_OUT=bench/results/session23/ab exec bench/results/session22/e2e_ab.sh "$@"
