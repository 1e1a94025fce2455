#!/usr/bin/env bash
# First start-up of the embedded model (LLM() with default flags) on an empty kernel-selection
# cache, the native kernels already built, two trees alternated:
#   bash bench/results/session31/cold_start.sh OLD_REV [ROUNDS]
# OLD_REV is checked out into /tmp/kvs_old; the new side is this tree. Prints seconds per run.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
OLD="${1:?usage: cold_start.sh OLD_REV [ROUNDS]}"; ROUNDS="${2:-2}"
rm -rf /tmp/kvs_old && git -C "$ROOT" worktree add -f --detach /tmp/kvs_old "$OLD" > /dev/null 2>&1
# NOTE: one cache directory per tree, only its kernel_select/ emptied before each run: a fresh
# directory, or one another tree built in, rebuilds the native kernels (their build files
# name the source paths).
run() {  # tree label
  local cache="/tmp/kvs_cold_cache_${1//\//_}"
  rm -rf "$cache/kernel_select"
  (cd "$1" && KVSERVE_CACHE_DIR="$cache" "$ROOT/.venv/bin/python" -c "
import time
t = time.perf_counter()
from kvserve import LLM
LLM()
print('$2 start-up %.1f s' % (time.perf_counter() - t))" 2>&1 | grep "start-up")
}
run /tmp/kvs_old warm-up > /dev/null; run "$ROOT" warm-up > /dev/null  # native builds, once
date -u +"# %Y-%m-%dT%H:%M:%SZ $(git -C "$ROOT" rev-parse --short HEAD) (+ working tree) vs $OLD; $(lscpu | grep 'Model name' | tr -s ' ')"
for r in $(seq "$ROUNDS"); do run /tmp/kvs_old "old $OLD"; run "$ROOT" new; done
git -C "$ROOT" worktree remove --force /tmp/kvs_old
