#!/usr/bin/env bash
# Does kvserve's ShareGPT throughput follow the host's read bandwidth? Five rounds of
# `torch.sum` over 1 GiB (2 threads, best of 3) right before and after a ShareGPT 64 @ 32 run.
#   bench/results/session29/bw_sharegpt.sh > bench/results/session29/bw_sharegpt.txt
set -euo pipefail
cd "$(dirname "$0")/../../.."
W=bench/results/session29/sitting/sharegpt/workload_sharegpt_64.jsonl
OUT=bench/results/session29/bw_sharegpt; mkdir -p "$OUT"
bw() { .venv/bin/python -c "
import time, torch
torch.set_num_threads(2)
x = torch.ones(1 << 28)
best = 0.0
for _ in range(3):
    t = time.perf_counter(); x.sum(); best = max(best, x.numel() * 4 / (time.perf_counter() - t) / 1e9)
print(f'{best:.1f}')"; }
for i in 1 2 3 4 5; do
  a=$(bw)
  .venv/bin/kvserve bench throughput --workload-file "$W" --num-prompts 64 --max-num-seqs 32 \
    --num-threads 2 --output-json "$OUT/sharegpt_$i.json" > /dev/null 2>&1
  b=$(bw)
  echo "$(date -u +%H:%M:%S) round $i: torch.sum $a / $b GB/s, ShareGPT $(.venv/bin/python -c "import json,sys; print(round(json.load(open(sys.argv[1]))['results']['output_tokens_per_s'], 1))" "$OUT/sharegpt_$i.json") tok/s"
done
