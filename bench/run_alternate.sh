#!/usr/bin/env bash
# kvserve and vLLM (bf16) alternated on the two traces where the AMX Xeon's ratio is marginal,
# uniform 128+128 at B=32 and ShareGPT-like 64 @ 32, on a sitting's workload files
# (bench/run_sitting.sh): kvserve, vLLM, kvserve, ... ending with kvserve (ROUNDS vLLM runs,
# default 3), so that each vLLM run has a kvserve run on each side and the host's drift shows
# in both. One line per run: the time, the system and round, output tok/s.
#
#   bench/run_alternate.sh SITTING_DIR [OUT_DIR] [ROUNDS]   (OUT_DIR default SITTING_DIR/alternate)
#
# bench/make_record.py SITTING_DIR then keeps these runs as the record's figures.alternate.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
S="${1:?usage: bench/run_alternate.sh SITTING_DIR [OUT_DIR] [ROUNDS]}"
OUT="${2:-$S/alternate}"
ROUNDS="${3:-3}"
cd "$ROOT"
mkdir -p "$OUT"
tps() { .venv/bin/python -c "import json,sys; print(round(json.load(open(sys.argv[1]))['results']['output_tokens_per_s'], 1))" "$1"; }
kv() {  # round
  .venv/bin/kvserve bench throughput --workload-file "$S/uniform/workload_128x128.jsonl" \
    --num-prompts 32 --max-num-seqs 32 --num-threads 2 --output-json "$OUT/kv_uniform_$1.json" > /dev/null 2>&1
  .venv/bin/kvserve bench throughput --workload-file "$S/sharegpt/workload_sharegpt_64.jsonl" \
    --num-prompts 64 --max-num-seqs 32 --num-threads 2 --output-json "$OUT/kv_sharegpt_$1.json" > /dev/null 2>&1
  echo "$(date -u +%H:%M:%S) kvserve $1: uniform B=32 $(tps "$OUT/kv_uniform_$1.json"), ShareGPT $(tps "$OUT/kv_sharegpt_$1.json") tok/s"
}
vl() {  # round
  BATCH_SIZES=32 SYSTEMS=vllm MODES=offline VLLM_DTYPES=bfloat16 bench/run_side_by_side.sh "$OUT/vllm_uniform_$1" 2>&1 | grep "tok/s" | sed "s/^/$(date -u +%H:%M:%S) /"
  WORKLOAD=sharegpt BATCH_SIZES=32 NUM_PROMPTS=64 MAX_OUTPUT_LEN=512 SYSTEMS=vllm MODES=offline VLLM_DTYPES=bfloat16 \
    bench/run_side_by_side.sh "$OUT/vllm_sharegpt_$1" 2>&1 | grep "tok/s" | sed "s/^/$(date -u +%H:%M:%S) /"
}
for i in $(seq "$ROUNDS"); do kv "$i"; vl "$i"; done
kv $((ROUNDS + 1))
