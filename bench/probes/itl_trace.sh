#!/usr/bin/env bash
# One traced server run of issue 21's trace: `kvserve serve` with every engine step recorded
# (bench/probes/serve_trace.py), the 40-request ShareGPT-like trace at RATE req/s, then the
# client's ITL / TTFT and the steps' split (decode-only vs with prefill, tokens a step).
#
#   bench/probes/itl_trace.sh OUT_DIR LABEL [server flags...]
#   e.g. bench/probes/itl_trace.sh /tmp/itl ms20 --step-budget --ttft-aging 0 --max-step-ms 20
#
# Env: RATE (1.5), PORT (8150), WRAP (a wrapper run before serve_trace.py, e.g.
# bench/probes/no_chunk_kernel.py), W (the workload: issue 21's trace, seed 11).
# Writes OUT_DIR/LABEL.json (steps), LABEL_client.json/.txt (kvserve bench serve).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
OUT="${1:?usage: itl_trace.sh OUT_DIR LABEL [server flags...]}"; L="${2:?label}"; shift 2
export PYTHONPATH="$ROOT" OMP_NUM_THREADS=2
PY=.venv/bin/python
PORT="${PORT:-8150}"; URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"
W="${W:-$OUT/workload_sharegpt_40.jsonl}"
[ -f "$W" ] || $PY -m kvserve.cli bench workload --workload sharegpt --max-output-len 128 \
  --num-prompts 40 --workload-seed 11 --save-workload "$W" > /dev/null
# shellcheck disable=SC2086
$PY ${WRAP:-} bench/probes/serve_trace.py "$OUT/$L.json" serve --port "$PORT" --num-threads 2 \
  --quiet "$@" > "$OUT/server_$L.log" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do curl -sf "$URL/health" > /dev/null 2>&1 && break; sleep 1; done
$PY -m kvserve.cli bench serve --base-url "$URL" --workload random --num-prompts 6 --input-len 96 \
  --output-len 24 --request-rate 3 --workload-seed 1 > /dev/null
$PY -m kvserve.cli bench serve --base-url "$URL" --workload-file "$W" --request-rate "${RATE:-1.5}" \
  --workload-seed 11 --label "$L" --system kvserve --output-json "$OUT/${L}_client.json" \
  > "$OUT/${L}_client.txt"
kill "$PID"; wait "$PID" 2>/dev/null || true
echo "== $L $(date -u +%H:%M:%S)"
grep -E 'output_tokens_per_s|^itl|^ttft' "$OUT/${L}_client.txt"
$PY - "$OUT/$L.json" <<'PY'
import json, sys
import numpy as np
R = json.load(open(sys.argv[1]))
t = np.array([(r["t1"] - r["t0"]) * 1e3 for r in R])
nd = np.array([r["num_decode_tokens"] for r in R])
npf = np.array([r["num_prefill_tokens"] for r in R])
mixed = (npf > 0) & (nd > 0)
print("decode-only steps ms p50/90/99:", np.percentile(t[npf == 0], [50, 90, 99]).round(1),
      "| steps with prefill beside decodes:", int(mixed.sum()),
      "tokens a step median", float(np.median(npf[mixed])) if mixed.any() else 0,
      "ms median", round(float(np.median(t[mixed])), 1) if mixed.any() else 0,
      "| ITL samples in prefill steps %.1f %%" % (100 * nd[npf > 0].sum() / max(1, nd.sum())))
PY
