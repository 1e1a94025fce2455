#!/usr/bin/env bash
# The per-layer ops hot (bench/probes/layer_ops_hot.py) on the emulated AVX2 kind (kernels for
# x86-64-v3, oneDNN / ATen / MKL capped at AVX2), OLD and NEW kvserve_cpu_ops.cpp in turn.
# Usage: bench/results/session24/layer_ops_avx2_ab.sh OLD.cpp NEW.cpp ROUNDS
set -euo pipefail
old=$1 new=$2 rounds=${3:-2}
src=kvserve/runtime/native/kvserve_cpu_ops.cpp
keep=$(mktemp); cp "$src" "$keep"; trap 'cp "$keep" "$src"' EXIT
export KVSERVE_NATIVE_MARCH=x86-64-v3 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
export MKL_ENABLE_INSTRUCTIONS=AVX2 KVSERVE_CACHE_DIR=${KVSERVE_CACHE_DIR:-/tmp/kvc_avx2c} PYTHONPATH=.
for round in $(seq "$rounds"); do
  for side in old new; do
    if [ $side = old ]; then cp "$old" "$src"; else cp "$new" "$src"; fi
    echo "== round $round, $side"
    .venv/bin/python bench/probes/layer_ops_hot.py --dtype float32 bfloat16 | grep threads
  done
done
