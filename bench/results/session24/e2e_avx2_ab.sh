#!/usr/bin/env bash
# End to end on the emulated AVX2-only kind (the Zen 3 EPYC: kernels for x86-64-v3, oneDNN /
# ATen capped at AVX2, --dtype float32 as `auto` picks without native bf16): kvserve's offline
# throughput on the sitting's traces, OLD and NEW kvserve_cpu_ops.cpp in turn (the quantized
# kernels as in the tree, capped to AVX2 by the build target).
# Usage: bench/results/session24/e2e_avx2_ab.sh OLD.cpp NEW.cpp ROUNDS TRACE_DIR
set -euo pipefail
old=$1 new=$2 rounds=$3 traces=$4
src=kvserve/runtime/native/kvserve_cpu_ops.cpp
keep=$(mktemp); cp "$src" "$keep"; trap 'cp "$keep" "$src"' EXIT
export KVSERVE_NATIVE_MARCH=x86-64-v3 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
export KVSERVE_CACHE_DIR=${KVSERVE_CACHE_DIR:-/tmp/kvc_avx2b}
out=$(mktemp -d)
run() {  # trace num_prompts max_num_seqs
  .venv/bin/kvserve bench throughput --dtype float32 --workload-file "$1" --num-prompts "$2" \
    --max-num-seqs "$3" --num-threads 2 --output-json "$out/r.json" > /dev/null 2>&1
  python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['results']['output_tokens_per_s'], 1))" "$out/r.json"
}
for round in $(seq "$rounds"); do
  for side in old new; do
    if [ $side = old ]; then cp "$old" "$src"; else cp "$new" "$src"; fi
    u=$traces/uniform/workload_128x128.jsonl s=$traces/sharegpt/workload_sharegpt_64.jsonl
    echo "== round $round, $side: uniform B=1 $(run "$u" 1 1), B=8 $(run "$u" 8 8), B=32 $(run "$u" 32 32); ShareGPT 64 @ 32 $(run "$s" 64 32) tok/s"
  done
done
