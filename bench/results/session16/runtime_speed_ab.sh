#!/usr/bin/env bash
# Bare decode (kvserve.bench.runtime_speed) at B=1 and 8: the previous commit 174d8bb (a
# worktree at /tmp/base_head) against this one, alternated three times.
cd /work/main
for i in 1 2 3; do for v in base new; do
  D=$([ $v = base ] && echo /tmp/base_head || echo /work/main)
  (cd $D && PYTHONPATH=$D OMP_NUM_THREADS=2 /work/main/.venv/bin/python -m kvserve.bench.runtime_speed \
     --batch-sizes 1 8 --steps 128 --repeats 5 --prompt-len 128 --threads 2 2>&1 | grep -E "^B=" \
     | sed "s/^/$(date -u +%H:%M:%S) $v $i /")
done; done
