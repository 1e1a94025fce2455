"""torch.profiler over a whole `kvserve bench throughput` run: the self-CPU table.

    PYTHONPATH=. .venv/bin/python bench/results/session21/e2e_profile.py bench throughput \
        --workload-file bench/results/session21/first/sharegpt/workload_sharegpt_64.jsonl \
        --num-prompts 64 --max-num-seqs 32 --num-threads 2

The arguments are the `kvserve` CLI's. The profiler slows the run and inflates some ops
(`aten::copy_` and `aten::fill_` in session 21); logits_time.py times the logits directly.
"""

from __future__ import annotations

import sys

from torch.profiler import ProfilerActivity, profile

from kvserve.cli import main

if __name__ == "__main__":
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        try:
            main(sys.argv[1:])
        except SystemExit:
            pass
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
