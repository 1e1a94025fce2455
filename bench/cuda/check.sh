#!/usr/bin/env bash
# The CUDA check, run on a lent GPU machine from the repository root after bench/cuda/prepare.sh
# here (device tool, carry [".gpu"]), in two calls that each fit the 10-minute limit:
#   bash bench/cuda/check.sh tests   # tests/cuda, the Triton kernels compiled (TRITON_INTERPRET=0)
#   bash bench/cuda/check.sh bench   # figures on a SmolLM2-135M-shaped model, random bf16 weights
# (no argument: both). "bench" measures the device's copy bandwidth (the HBM anchor), then bare
# decode (kvserve.bench.runtime_speed) and the engine end to end (kvserve bench throughput) at
# B=1, 32 and 256, with the Triton backend and with torch_sdpa. Records go to $OUT.
stage="${1:-all}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD KVSERVE_TEST_TOKENIZER_DIR=$PWD/.gpu/tok PYTHONUNBUFFERED=1
# NOTE: tests/conftest.py defaults it to 1 (the CPU interpreter); here the kernels compile.
export TRITON_INTERPRET=0
OUT="${OUT:-/tmp/cuda-check}"; mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, \
triton.__version__, torch.cuda.get_device_name())"
lscpu | grep 'Model name'; nproc
date -u +%H:%M:%S
if [ "$stage" = all ] || [ "$stage" = tests ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rA tests/cuda 2>&1 | tee "$OUT/pytest.log" \
    | grep -E "passed|failed|error|logprob diff"
  date -u +%H:%M:%S
fi
[ "$stage" = all ] || [ "$stage" = bench ] || exit 0
# The anchor: device-to-device copy bandwidth (read + write bytes per second), best of 20.
python3 -c "
import torch
x = torch.empty(1 << 31, dtype=torch.uint8, device='cuda'); y = torch.empty_like(x)
best = 1e9
for _ in range(20):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); y.copy_(x); b.record(); torch.cuda.synchronize(); best = min(best, a.elapsed_time(b) / 1e3)
print(f'copy bandwidth {2 * x.numel() / best / 1e9:.0f} GB/s')" | tee "$OUT/bandwidth.txt"
M=/tmp/smol-random
python3 bench/cuda/random_smollm.py "$M" .gpu/config .gpu/tok 2>&1 | tail -1
KV="python3 -m kvserve.cli"
$KV bench workload --input-len 128 --output-len 128 --num-prompts 256 --vocab-size 49152 \
  --save-workload /tmp/u.jsonl > /dev/null
for be in triton torch_sdpa; do
  timeout 90 python3 -m kvserve.bench.runtime_speed --model "$M" --device cuda --attn-backend $be \
    --batch-sizes 1 32 256 --steps 64 --prompt-len 128 --repeats 3 2>&1 \
    | tee "$OUT/runtime_speed_$be.txt" | grep -E "^B="
  for b in 1 32 256; do
    timeout 60 $KV bench throughput --model "$M" --device cuda --attention-backend $be \
      --workload-file /tmp/u.jsonl --num-prompts $b --max-num-seqs $b --num-kv-blocks 8192 \
      --output-json "$OUT/e2e_${be}_b$b.json" 2>&1 | tail -4
  done
  date -u +%H:%M:%S
done
