#!/usr/bin/env bash
# Offline e2e A/B of the fused decoder layers: `kvserve bench throughput` with the fused call
# on (default) and off (KVSERVE_FUSED_LAYERS=0), alternated twice; uniform 128+128 at B=1/8/32
# and ShareGPT-like 64 requests at 32 in flight (the issue-15 traces).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=bench/results/session17/throughput_ab; mkdir -p "$OUT"
KV=.venv/bin/kvserve
[ -f "$OUT/workload_128x128.jsonl" ] || "$KV" bench workload --input-len 128 --output-len 128 \
  --num-prompts 32 --vocab-size 49152 --save-workload "$OUT/workload_128x128.jsonl" > /dev/null
[ -f "$OUT/workload_sharegpt_64.jsonl" ] || "$KV" bench workload --workload sharegpt \
  --max-output-len 512 --num-prompts 64 --vocab-size 49152 \
  --save-workload "$OUT/workload_sharegpt_64.jsonl" > /dev/null
run() {  # tag workload num_prompts max_num_seqs
  local j="$OUT/${1}_$(basename "$2" .jsonl)_b$4_r$i.json"
  env $([ "$1" = off ] && echo KVSERVE_FUSED_LAYERS=0) "$KV" bench throughput --workload-file "$2" \
    --num-prompts "$3" --max-num-seqs "$4" --num-threads 2 --output-json "$j" > /dev/null 2>&1
  echo "$(date -u +%H:%M:%S) fused $1 $(basename "$2") B=$4: $(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['results']['output_tokens_per_s'], 1))" "$j") tok/s"
}
for i in 1 2; do for tag in on off; do
  for b in 1 8 32; do run $tag "$OUT/workload_128x128.jsonl" "$b" "$b"; done
  run $tag "$OUT/workload_sharegpt_64.jsonl" 64 32
done; done
