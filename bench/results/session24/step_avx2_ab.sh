#!/usr/bin/env bash
# Bare decode (runtime_speed --floor) on the emulated AVX2 kind (the Zen 3 EPYC: kernels for
# x86-64-v3, oneDNN / ATen capped at AVX2, --dtype float32 as `auto` picks on a CPU without
# native bf16), old and new kvserve_cpu_ops.cpp in turn.
# Usage: bench/results/session24/step_avx2_ab.sh OLD.cpp NEW.cpp ROUNDS [DTYPE]
set -euo pipefail
old=$1 new=$2 rounds=${3:-2} dtype=${4:-float32}
src=kvserve/runtime/native/kvserve_cpu_ops.cpp
keep=$(mktemp); cp "$src" "$keep"; trap 'cp "$keep" "$src"' EXIT
export KVSERVE_NATIVE_MARCH=x86-64-v3 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
export KVSERVE_CACHE_DIR=${KVSERVE_CACHE_DIR:-/tmp/kvc_avx2}
for round in $(seq "$rounds"); do
  for side in old new; do
    if [ $side = old ]; then cp "$old" "$src"; else cp "$new" "$src"; fi
    echo "== round $round, $side"
    .venv/bin/python -m kvserve.bench.runtime_speed --dtype "$dtype" --batch-sizes 1 8 32 \
      --steps 48 --prompt-len 128 --threads 2 --repeats 3 --floor 2>&1 | grep -E "^B=|matmuls alone"
  done
done
