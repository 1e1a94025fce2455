#!/usr/bin/env bash
# The accuracy harness with prefill chunks through the decode kernel (the engine's default
# choice) and with every chunk on SDPA (bench/probes/no_chunk_kernel.py), dense fp32 and bf16.
cd "$(dirname "$0")/../../../.."
A=(--settings fp32,bf16 --ppl-tokens 1024 --num-prompts 8 --gen-tokens 64 --num-recall 8 --recall-filler 300 --threads 2)
D=bench/results/session17/accuracy
echo "kernel $(date -u +%H:%M:%S)"; PYTHONPATH=. .venv/bin/python -m kvserve.bench.accuracy "${A[@]}" --json $D/chunk_kernel.json 2>&1 | grep -E "^\|" 
echo "sdpa $(date -u +%H:%M:%S)"; PYTHONPATH=. .venv/bin/python bench/probes/no_chunk_kernel.py -m kvserve.bench.accuracy "${A[@]}" --json $D/chunk_sdpa.json 2>&1 | grep -E "^\|"
echo "done $(date -u +%H:%M:%S)"
