#!/usr/bin/env bash
# A/B of the decode attention kernels on the AVX2 path, emulated on this CPU: the kernels built
# for x86-64-v3 (KVSERVE_NATIVE_MARCH), oneDNN / ATen capped at AVX2. OLD / NEW: two copies of
# kvserve_cpu_ops.cpp, swapped in turn (each builds once into its own hashed directory).
# Usage: bench/results/session24/attn_avx2_ab.sh OLD.cpp NEW.cpp ROUNDS
set -euo pipefail
old=$1 new=$2 rounds=${3:-2}
src=kvserve/runtime/native/kvserve_cpu_ops.cpp
keep=$(mktemp); cp "$src" "$keep"; trap 'cp "$keep" "$src"' EXIT
export KVSERVE_NATIVE_MARCH=x86-64-v3 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
export KVSERVE_CACHE_DIR=${KVSERVE_CACHE_DIR:-/tmp/kvc_avx2} PYTHONPATH=.
for round in $(seq "$rounds"); do
  for side in old new; do
    if [ $side = old ]; then cp "$old" "$src"; else cp "$new" "$src"; fi
    echo "== round $round, $side"
    .venv/bin/python bench/probes/attn_cold.py --dtype float32 bfloat16 --len 160 --layers 1 --threads 1 | grep "random"
    .venv/bin/python bench/probes/attn_cold.py --dtype float32 bfloat16 --len 160 --layers 48 --threads 2 | grep "threads 2"
    .venv/bin/python bench/probes/attn_cold.py --dtype float32 --batch 1 --len 160 --layers 30 --threads 2 | grep "random"
  done
done
