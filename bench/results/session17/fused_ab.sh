#!/usr/bin/env bash
# A/B of the fused decoder layers (kvserve/models/fused_layers.py): the same tree, the fused
# call on (default) and off (KVSERVE_FUSED_LAYERS=0), alternated; bare decode, best of 3.
cd "$(dirname "$0")/../../.."
for i in 1 2 3; do for v in on off; do
  echo "== fused $v $(date -u +%H:%M:%S)"
  env $([ $v = off ] && echo KVSERVE_FUSED_LAYERS=0) OMP_NUM_THREADS=2 .venv/bin/python -m kvserve.bench.runtime_speed \
    --batch-sizes 1 8 32 --steps 64 --prompt-len 128 --threads 2 --repeats 3 --floor 2>&1 | grep -E "^B=|matmuls alone|bandwidth bound"
done; done
