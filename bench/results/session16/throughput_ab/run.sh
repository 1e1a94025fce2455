#!/usr/bin/env bash
# Offline 128+128 at B=1 and B=8 (kvserve bench throughput, defaults, 2 threads), the
# previous commit (174d8bb, a worktree at /tmp/base_head) against this one, alternated.
cd /work/main
OUT=bench/results/session16/throughput_ab
W=$OUT/workload_128x128.jsonl
for i in 1 2 3; do for B in 1 8; do for v in base new; do
  D=$([ $v = base ] && echo /tmp/base_head || echo /work/main)
  r=$(cd $D && PYTHONPATH=$D OMP_NUM_THREADS=2 /work/main/.venv/bin/python -m kvserve.cli bench throughput \
      --workload-file /work/main/$W --num-prompts $B --max-num-seqs $B --num-threads 2 2>&1 | grep -E "output_tokens_per_s|output tok" | head -1)
  echo "$(date -u +%H:%M:%S) B=$B $v $i: $r"
done; done; done
