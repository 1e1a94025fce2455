#!/usr/bin/env bash
# Issue 21 on a shared (loaded) box: the ITL trace against several policies, interleaved.
#
#   bench/run_itl_ab.sh [OUT_DIR]          (default bench/results/itl_ab)
#
# One server per policy, all started at once (ports PORT, PORT+1, ...; idle servers cost no
# CPU), then for each repeat and rate the same trace goes to each policy in turn, so every
# policy sees the same background load. Policies and their flags: bench/run_itl.sh (`--flags`).
# Records: OUT_DIR/sweep/<policy>_<rate>_r<repeat>.json; each server's /metrics (the step
# budget's counters and cost fit) at the end; `kvserve bench itl-report` -> OUT_DIR/report.md.
#
# Env: POLICIES ("baseline budget budget-fixed"), RATES ("1.5 3"), REPEATS (1),
#      NUM_PROMPTS (40), THREADS (2), PORT (8130), SLO_ITL_MS (55), PY (.venv/bin/python),
#      OLD_TREE (a checkout of an older commit, e.g. from `git worktree add`): a policy
#      named old-P runs P's flags on that tree's code, so old and new code share a sitting.
set -euo pipefail
REPO_ROOT="${REPO_ROOT:-$(cd "$(dirname "$0")/.." && pwd)}"
cd "$REPO_ROOT"
OUT="${1:-bench/results/itl_ab}"
PY="${PY:-$REPO_ROOT/.venv/bin/python}"
POLICIES="${POLICIES:-baseline budget budget-fixed}"
RATES="${RATES:-1.5 3}"
REPEATS="${REPEATS:-1}"
NUM_PROMPTS="${NUM_PROMPTS:-40}"
THREADS="${THREADS:-2}"
PORT="${PORT:-8130}"
SLO_ITL_MS="${SLO_ITL_MS:-55}"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="$THREADS"
KV=("$PY" -m kvserve.cli)
mkdir -p "$OUT/sweep"
OUT="$(cd "$OUT" && pwd)"  # absolute: old-P servers run in another directory
log() { echo "[run_itl_ab $(date +%H:%M:%S)] $*" >&2; }

W="$OUT/workload_sharegpt_${NUM_PROMPTS}.jsonl"
"${KV[@]}" bench workload --workload sharegpt --max-output-len 128 \
  --num-prompts "$NUM_PROMPTS" --workload-seed 11 --save-workload "$W"
{ echo "date $(date -Is)"; echo "host $(uname -srm), $(nproc) cores"; \
  lscpu | grep -E 'Model name|^Flags' | cut -c1-400; \
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"; \
  echo "load at start: $(cut -d' ' -f1-3 /proc/loadavg)"; echo "slo_itl_ms $SLO_ITL_MS"; } \
  > "$OUT/versions.txt"

declare -A URL_OF
PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT
port=$PORT
for policy in $POLICIES; do
  flags="$(bash bench/run_itl.sh --flags "${policy#old-}")"
  tree="$REPO_ROOT"
  if [ "${policy#old-}" != "$policy" ]; then tree="${OLD_TREE:?old-$policy needs OLD_TREE}"; fi
  log "server: $policy on :$port ($flags; code from $tree)"
  # NOTE: run from the tree itself: python -m puts the working directory ahead of PYTHONPATH.
  # shellcheck disable=SC2086
  (cd "$tree" && PYTHONPATH="$tree" exec "${KV[@]}" serve --port "$port" --num-threads "$THREADS" \
    --quiet $flags) > "$OUT/server_$policy.log" 2>&1 &
  PIDS+=("$!")
  URL_OF[$policy]="http://127.0.0.1:$port"
  port=$((port + 1))
done
for policy in $POLICIES; do
  url="${URL_OF[$policy]}"
  for _ in $(seq 1 600); do curl -sf "$url/health" > /dev/null 2>&1 && break; sleep 1; done
  # Warm-up (not recorded): first kernels, allocator, the step cost model's first fit.
  "${KV[@]}" bench serve --base-url "$url" --workload random --num-prompts 6 --input-len 96 \
    --output-len 24 --request-rate 3 --workload-seed 1 > /dev/null
done

t0=$(date +%s)
for rep in $(seq 1 "$REPEATS"); do
  for rate in $RATES; do
    for policy in $POLICIES; do
      log "$policy at $rate req/s (repeat $rep; load $(cut -d' ' -f1 /proc/loadavg))"
      # NOTE: a salt per run: the same prompts sent again would hit the server's prefix
      # cache, so every run after a server's first would prefill almost nothing.
      "${KV[@]}" bench serve --base-url "${URL_OF[$policy]}" --workload-file "$W" \
        --request-rate "$rate" --workload-seed 11 --slo-itl "$SLO_ITL_MS" --label "$policy" \
        --extra-body "{\"cache_salt\": \"run-$rate-$rep\"}" \
        --system kvserve --output-json "$OUT/sweep/${policy}_${rate}_r${rep}.json" \
        > "$OUT/sweep/${policy}_${rate}_r${rep}.txt"
      grep -E 'output_tokens_per_s|^itl|^ttft' "$OUT/sweep/${policy}_${rate}_r${rep}.txt" >&2 || true
    done
  done
done
for policy in $POLICIES; do
  curl -sf "${URL_OF[$policy]}/metrics" > "$OUT/metrics_$policy.txt" || true
done
"${KV[@]}" bench itl-report "$OUT/sweep" | tee "$OUT/report.md"
log "done in $(( $(date +%s) - t0 )) s; tables in $OUT/report.md"
