#!/usr/bin/env bash
# Bare-decode A/B of a kernel tried and not kept (amx_int8.patch beside this script): the x16
# int8 kernel's dots on AMX tiles (TDPBSUD / TDPBSSD per block of 32, scaled as the VNNI kernel
# scales, equal to it bit for bit) offered to the selection as "{qtype}_x16_amx_int8".
# The patch carries a switch for this A/B: AB_NO_INT8=1 leaves the candidate out. Each side
# keeps its own selection (KVSERVE_CACHE_DIR); alternated ROUNDS times. The record beside this
# script (amx_int8_ab.txt) was taken with the patch applied to 545a8d6 and the 9-16 bucket;
# the patch now applies to the tree as of session 20's end (min_rows already there).
# DTYPE=bfloat16 passes --dtype bfloat16 (amx_int8_bf16_ab.txt): with --dtype auto the fp32
# plan takes amx_int8 too, and the bf16 / fp32 decision can flip to fp32 (the first record's
# prefill ran at the fp32 rate).
#   git apply bench/results/session20/amx_int8.patch
#   [DTYPE=bfloat16] bench/results/session20/amx_int8_ab.sh [ROUNDS=2]
set -euo pipefail
cd "$(dirname "$0")/../../.."
ROUNDS=${1:-2}
for i in $(seq "$ROUNDS"); do
  for v in 0 1; do
    mkdir -p "/tmp/kvserve-int8-cache-$v"
    echo "no_int8=$v"
    KVSERVE_CACHE_DIR="/tmp/kvserve-int8-cache-$v" AB_NO_INT8=$v .venv/bin/python \
      -m kvserve.bench.runtime_speed --batch-sizes 1 8 12 16 24 32 --steps 64 --repeats 3 \
      --threads 2 ${DTYPE:+--dtype "$DTYPE"} 2>&1 | grep "^B=\|^dtype" | cut -c1-90
  done
done
