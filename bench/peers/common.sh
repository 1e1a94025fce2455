# Shared settings for the peer scripts (sourced, not run).
# Peers live OUTSIDE the repository, under $KVSERVE_PEERS (default ~/.cache/kvserve-peers).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS_HOME="${KVSERVE_PEERS:-$HOME/.cache/kvserve-peers}"
PYTHON="${PYTHON:-python3.11}"
THREADS="${THREADS:-2}"
KVSERVE_PY="$REPO_ROOT/.venv/bin/python"
VLLM_VENV="$PEERS_HOME/vllm-venv"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
LLAMA_CPP_PY_VERSION="${LLAMA_CPP_PY_VERSION:-0.3.36}"
LLAMA_CPP_DIR="$PEERS_HOME/llama.cpp"
HF_MODEL_DIR="$PEERS_HOME/smollm2-135m-hf-fp32"
mkdir -p "$PEERS_HOME"

# The embedded GGUF (kvserve's default model), found without importing its package.
embedded_gguf() {
  "$KVSERVE_PY" -c 'from kvserve.models.loader import default_model_path; print(default_model_path())'
}

# Record "name version" in $PEERS_HOME/versions.txt (replacing an older line for name).
record_version() {
  local name="$1" version="$2" file="$PEERS_HOME/versions.txt"
  touch "$file"
  grep -v "^$name " "$file" > "$file.tmp" || true
  echo "$name $version" >> "$file.tmp"
  mv "$file.tmp" "$file"
}
