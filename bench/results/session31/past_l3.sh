#!/usr/bin/env bash
# Bare decode past the last-level cache on each CPU kind's code paths, run on this host:
# a random-weight GGUF of SmolLM2-1.7B's shape in Q4_1 (1.07 GB a decode step, past the AMX
# Xeon's 300 MB L3; bench/probes/past_l3_model.py), `runtime_speed --floor` at B=1 and 8 on
#   native       this CPU's own paths (AMX here),
#   cooperlake   AVX-512 + BF16 + VNNI without AMX (Zen 4's and the AMX-less Xeon's paths),
#   x86-64-v3    AVX2 only (the Zen 3 EPYC's paths; fp32, as --dtype auto picks there),
# each with its own kernel build and selection cache (README, "Emulating another CPU kind").
#   bash bench/results/session31/past_l3.sh [MODEL.gguf]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
MODEL="${1:-/tmp/past_l3/smollm2-1.7b-q4_1.gguf}"
cd "$ROOT"
[ -f "$MODEL" ] || PYTHONPATH=. .venv/bin/python bench/probes/past_l3_model.py "$MODEL"
ARGS=(--model "$MODEL" --batch-sizes 1 8 --steps 32 --prompt-len 128 --threads 2 --repeats 3 --floor)
date -u +"# %Y-%m-%dT%H:%M:%SZ $(git rev-parse --short HEAD); $(lscpu | grep 'Model name' | tr -s ' ')"
kind() {  # name, env...
  local name="$1"; shift
  echo "## $name"
  env "$@" .venv/bin/python -m kvserve.bench.runtime_speed "${ARGS[@]}" 2>&1 \
    | grep -E "^dtype|bandwidth|B=|matmuls alone" | cut -c1-400
}
kind native KVSERVE_CACHE_DIR=/tmp/kvc_native_l3
kind cooperlake KVSERVE_CACHE_DIR=/tmp/kvc_coop KVSERVE_NATIVE_MARCH=cooperlake \
  ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16
ARGS+=(--dtype float32)
kind x86-64-v3 KVSERVE_CACHE_DIR=/tmp/kvc_v3 KVSERVE_NATIVE_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 \
  ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
