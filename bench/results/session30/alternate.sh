#!/usr/bin/env bash
# Session 30's alternated runs (kvserve, vLLM bf16, ... on uniform B=32 and ShareGPT 64 @ 32)
# on the sitting's workload files; the body is bench/run_alternate.sh.
#   bench/results/session30/alternate.sh > bench/results/session30/alternate.txt
set -euo pipefail
cd "$(dirname "$0")/../../.."
exec bench/run_alternate.sh bench/results/session30/sitting bench/results/session30/alternate 3
