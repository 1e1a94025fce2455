#!/usr/bin/env bash
# The CUDA check, run on a lent GPU machine from the repository root after bench/cuda/prepare.sh
# here (device tool: command `bash bench/cuda/check.sh`, carry [".gpu"]): tests/cuda, then
# kvserve's figures on a SmolLM2-135M-shaped model with random bf16 weights. Records go to $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD KVSERVE_TEST_TOKENIZER_DIR=$PWD/.gpu/tok PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/cuda-check}"; mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
lscpu | grep 'Model name'; nproc
date -u +%H:%M:%S
timeout 180 python3 -m pytest -q -p no:cacheprovider -rA tests/cuda 2>&1 | tee "$OUT/pytest.log" \
  | grep -E "passed|failed|error|logprob diff"
date -u +%H:%M:%S
M=/tmp/smol-random
python3 bench/cuda/random_smollm.py "$M" .gpu/config .gpu/tok 2>&1 | tail -1
KV="python3 -m kvserve.cli"
$KV bench workload --input-len 128 --output-len 128 --num-prompts 256 --vocab-size 49152 \
  --save-workload /tmp/u.jsonl > /dev/null
for b in 1 32 256; do
  timeout 60 $KV bench throughput --model "$M" --device cuda --workload-file /tmp/u.jsonl \
    --num-prompts $b --max-num-seqs $b --num-kv-blocks 8192 --output-json "$OUT/h200_b$b.json" \
    2>&1 | tail -4
done
# Where an engine step's time goes at B=256 (cProfile; py-spy, tried first, ran past 90 s).
timeout 200 python3 -m cProfile -o /tmp/b256.pstats -m kvserve.cli bench throughput --model "$M" \
  --device cuda --workload-file /tmp/u.jsonl --num-prompts 256 --max-num-seqs 256 \
  --num-kv-blocks 8192 --output-json "$OUT/h200_b256_cprofile.json" 2>&1 | grep -E "tpot|output_tokens"
python3 -c "
import pstats; st = pstats.Stats('/tmp/b256.pstats').sort_stats('tottime'); st.print_stats(25)
st.print_callers('scaled_dot_product_attention')" > "$OUT/h200_b256_cprofile.txt"
date -u +%H:%M:%S
timeout 90 python3 -m kvserve.bench.runtime_speed --model "$M" --device cuda --batch-sizes 1 32 256 \
  --steps 64 --prompt-len 128 --repeats 3 2>&1 | tee "$OUT/runtime_speed.txt" | grep -E "^B="
date -u +%H:%M:%S
