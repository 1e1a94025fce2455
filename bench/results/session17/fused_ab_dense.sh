#!/usr/bin/env bash
# A/B of the fused decoder layers on a dense model (the HF safetensors of the embedded model,
# fp32 on disk; kvserve's defaults run it in bf16 on oneDNN prepacked weights here), the call
# on and off (KVSERVE_FUSED_LAYERS=0), alternated; bare decode, best of 3.
cd "$(dirname "$0")/../../.."
M=${MODEL:-$HOME/.cache/kvserve-peers/smollm2-135m-hf-fp32}
for i in 1 2; do for v in on off; do
  echo "== fused $v $(date -u +%H:%M:%S)"
  env $([ $v = off ] && echo KVSERVE_FUSED_LAYERS=0) OMP_NUM_THREADS=2 .venv/bin/python -m kvserve.bench.runtime_speed \
    --model "$M" --batch-sizes 1 8 --steps 64 --prompt-len 128 --threads 2 --repeats 3 --floor 2>&1 | grep -E "^dtype|^B=|matmuls alone"
done; done
