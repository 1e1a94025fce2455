#!/usr/bin/env bash
# Issue 21: inter-token latency under arrivals, per prefill policy, on the real engine.
#
#   bench/run_itl.sh [OUT_DIR]          (default bench/out/itl, ignored)
#
# One server per policy (`kvserve serve`, 2 threads), the ShareGPT-like trace of the issue
# (40 requests, outputs clipped to 128, seed 11) sent by `kvserve bench serve` at each rate:
#   baseline  --no-step-budget                     main's behaviour: token budget 512
#   off       --no-step-budget --max-num-batched-tokens 8192   (no effective chunking)
#   fixed128  --no-step-budget --max-num-batched-tokens 128 (fixedN: a token budget of N)
#   budget    --step-budget (off by default): step-time budget, --prefill-policy shortest
#   budget-fcfs, budget-rr     the step budget with --prefill-policy fcfs / round-robin
#   budget-m1.5, budget-m2.5   the step budget with --step-decode-multiple 1.5 / 2.5
#   budget-fixed, budget-aX    the step budget with --ttft-aging 0 (no TTFT guard) / X
#   budget-fixed-mX            --ttft-aging 0 with --step-decode-multiple X
#                              (these four at 1.5 req/s only: VARIANTS)
#   budget-msX                 --ttft-aging 0 with an absolute target --max-step-ms X
#   budget-msX-aY              --max-step-ms X with --ttft-aging Y
#   static    the baseline server, the client batching statically (8 at a time)
# First a calibration run (baseline at 1.5 req/s) gives the ITL SLO: 2 x its median ITL
# (or SLO_ITL_MS); every later run is scored against it (`--slo-itl`, on each request's p99
# gap). Records go to OUT_DIR/<group>/<policy>_<rate>.json; then `kvserve bench itl-report`
# prints the tables (OUT_DIR/report.md) and `kvserve bench plot` draws, per group:
#   cdf_1.5/       ITL / TTFT / TPOT / e2e CDFs of off, baseline (512), fixed128, budget
#   variants_1.5/  budget with shortest / fcfs / round-robin, and other multiples
#   static_1.5/    TTFT of continuous (baseline) vs static batching
#   sweep/         goodput_vs_rate.png: SLO attainment, ITL p99/median, TTFT p90 by rate
#
# Env: RATES ("1.5 2 3 4"), POLICIES ("baseline off fixed128 budget"),
#      VARIANTS ("budget-fcfs budget-rr budget-m1.5 budget-m2.5"), NUM_PROMPTS (40),
#      THREADS (2), PORT (8123), SLO_ITL_MS (unset: calibrated), STATIC_BATCH (8),
#      PY (.venv/bin/python). Expected duration on an idle 2-core box: ~17 minutes
#      (a run of 40 requests ~30-50 s, a server start + warm-up ~15 s; 21 runs, 8 starts).
set -euo pipefail
REPO_ROOT="${REPO_ROOT:-$(cd "$(dirname "$0")/.." && pwd)}"
cd "$REPO_ROOT"
OUT="${1:-bench/out/itl}"
PY="${PY:-$REPO_ROOT/.venv/bin/python}"
RATES="${RATES:-1.5 2 3 4}"
POLICIES="${POLICIES:-baseline off fixed128 budget}"
VARIANTS="${VARIANTS:-budget-fcfs budget-rr budget-m1.5 budget-m2.5}"
NUM_PROMPTS="${NUM_PROMPTS:-40}"
THREADS="${THREADS:-2}"
PORT="${PORT:-8123}"
STATIC_BATCH="${STATIC_BATCH:-8}"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="$THREADS"
KV=("$PY" -m kvserve.cli)
URL="http://127.0.0.1:$PORT"
log() { echo "[run_itl $(date +%H:%M:%S)] $*" >&2; }

flags_of() {
  case "$1" in
    baseline | static) echo "--no-step-budget" ;;
    off) echo "--no-step-budget --max-num-batched-tokens 8192" ;;
    fixed[0-9]*) echo "--no-step-budget --max-num-batched-tokens ${1#fixed}" ;;
    budget) echo "--step-budget" ;;
    budget-fcfs) echo "--step-budget --prefill-policy fcfs" ;;
    budget-rr) echo "--step-budget --prefill-policy round-robin" ;;
    budget-ms*-a*) ms="${1#budget-ms}"; echo "--step-budget --max-step-ms ${ms%-a*} --ttft-aging ${1##*-a}" ;;
    budget-ms*) echo "--step-budget --ttft-aging 0 --max-step-ms ${1#budget-ms}" ;;
    budget-m*) echo "--step-budget --step-decode-multiple ${1#budget-m}" ;;
    budget-fixed) echo "--step-budget --ttft-aging 0" ;;
    budget-fixed-fcfs) echo "--step-budget --ttft-aging 0 --prefill-policy fcfs" ;;
    budget-fixed-m*) echo "--step-budget --ttft-aging 0 --step-decode-multiple ${1#budget-fixed-m}" ;;
    budget-a*) echo "--step-budget --ttft-aging ${1#budget-a}" ;;
    *) echo "unknown policy $1" >&2; exit 2 ;;
  esac
}
# `bench/run_itl.sh --flags POLICY` prints the server flags of POLICY.
if [ "${1:-}" = "--flags" ]; then flags_of "$2"; exit 0; fi
mkdir -p "$OUT"

W="$OUT/workload_sharegpt_${NUM_PROMPTS}.jsonl"
"${KV[@]}" bench workload --workload sharegpt --max-output-len 128 \
  --num-prompts "$NUM_PROMPTS" --workload-seed 11 --save-workload "$W"
{ echo "date $(date -Is)"; echo "host $(uname -srm), $(nproc) cores"; \
  lscpu | grep -E 'Model name|^Flags' | cut -c1-400; \
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"; \
  echo "load at start: $(cut -d' ' -f1-3 /proc/loadavg)"; } > "$OUT/versions.txt"

SERVER_PID=""
stop_server() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
  SERVER_PID=""
}
trap stop_server EXIT
start_server() {  # policy
  local flags; flags="$(flags_of "$1")"
  log "server: $1 ($flags)"
  # shellcheck disable=SC2086
  "${KV[@]}" serve --port "$PORT" --num-threads "$THREADS" --quiet $flags \
    > "$OUT/server_$1.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 300); do
    curl -sf "$URL/health" > /dev/null 2>&1 && break
    kill -0 "$SERVER_PID" 2>/dev/null || { log "server died, see $OUT/server_$1.log"; exit 1; }
    sleep 1
  done
  # Warm-up (not recorded): first kernels, allocator, and the step cost model's first fit.
  "${KV[@]}" bench serve --base-url "$URL" --workload random --num-prompts 6 --input-len 96 \
    --output-len 24 --request-rate 3 --workload-seed 1 > /dev/null
}
run() {  # policy group rate [extra bench flags...]
  local policy="$1" group="$2" rate="$3"; shift 3
  local slo=()
  [ -n "${SLO_ITL_MS:-}" ] && slo=(--slo-itl "$SLO_ITL_MS")
  log "$policy at $rate req/s -> $group"
  mkdir -p "$OUT/$group"
  # NOTE: a salt per run: the same prompts sent again would hit the server's prefix cache
  # (calibration, static and sweep share the baseline server), so later runs would prefill
  # almost nothing.
  "${KV[@]}" bench serve --base-url "$URL" --workload-file "$W" --request-rate "$rate" \
    --workload-seed 11 "${slo[@]}" --label "$policy" --system kvserve "$@" \
    --extra-body "{\"cache_salt\": \"$group-$rate\"}" \
    --output-json "$OUT/$group/${policy}_${rate}.json" > "$OUT/$group/${policy}_${rate}.txt"
  grep -E 'output_tokens_per_s|^itl|^ttft|slo_attainment' "$OUT/$group/${policy}_${rate}.txt" >&2 || true
}

t0=$(date +%s)
start_server baseline
if [ -z "${SLO_ITL_MS:-}" ]; then
  run baseline calibration 1.5
  SLO_ITL_MS=$("$PY" -c "import json,sys; r=json.load(open(sys.argv[1]))['results']; print(round(2e3*r['itl']['median'], 1))" \
    "$OUT/calibration/baseline_1.5.json")
  log "ITL SLO = 2 x baseline median ITL = $SLO_ITL_MS ms"
fi
echo "slo_itl_ms $SLO_ITL_MS" >> "$OUT/versions.txt"
run static static_1.5 1.5 --static-batch-size "$STATIC_BATCH"

for policy in $POLICIES; do
  [ "$policy" = baseline ] || { stop_server; start_server "$policy"; }
  for rate in $RATES; do
    group=sweep
    run "$policy" "$group" "$rate"
    if [ "$rate" = 1.5 ]; then
      mkdir -p "$OUT/cdf_1.5" "$OUT/static_1.5" "$OUT/variants_1.5"
      cp "$OUT/sweep/${policy}_1.5.json" "$OUT/cdf_1.5/"
      [ "$policy" = baseline ] && cp "$OUT/sweep/baseline_1.5.json" "$OUT/static_1.5/"
      [ "$policy" = budget ] && cp "$OUT/sweep/budget_1.5.json" "$OUT/variants_1.5/"
    fi
  done
done
for policy in $VARIANTS; do
  stop_server; start_server "$policy"
  run "$policy" variants_1.5 1.5
done
stop_server

# NOTE: nullglob: with VARIANTS empty (or no static run) the patterns match nothing and must
# drop out, not reach the report as literal paths.
shopt -s nullglob
extra=("$OUT"/variants_1.5/budget-*.json "$OUT"/static_1.5/static_*.json)
shopt -u nullglob
"${KV[@]}" bench itl-report "$OUT/sweep" "${extra[@]}" | tee "$OUT/report.md"
for group in cdf_1.5 variants_1.5 static_1.5 sweep; do
  [ -d "$OUT/$group" ] && "${KV[@]}" bench plot "$OUT/$group" --out-dir "$OUT/$group" > /dev/null
done
log "done in $(( $(date +%s) - t0 )) s; tables in $OUT/report.md, plots in $OUT/*/"
