#!/usr/bin/env bash
cd /work/main
for i in 1 2 3; do for v in base new; do D=$([ $v = base ] && echo /tmp/base_head || echo /work/main)
echo "== $v (tree $(cd $D && git rev-parse --short HEAD)$([ $v = new ] && echo ' + working tree')) $(date -u +%H:%M:%S)"
(cd $D && PYTHONPATH=$D OMP_NUM_THREADS=2 /work/main/.venv/bin/python /work/main/bench/probes/step_breakdown.py --batch-sizes 1 8 --steps 256 --repeats 3 --prompt-len 128 --threads 2 2>&1 | grep -E -A12 "^decode B=(1|8):" | grep -v "^--" | awk '/^decode B/{n++} n%3==0 || 1' )
done; done
