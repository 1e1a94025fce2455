#!/usr/bin/env bash
# Prepares .gpu/ (ignored) for bench/cuda/check.sh on a lent GPU machine that has torch and
# transformers but not this project's other needs, and no network: the gguf and llguidance
# wheels for its Python 3.12, and the embedded model's tokenizer files and HF config.json (the
# 98 MB GGUF itself is over the 64 MiB a device call carries, so the checks use random-weight
# models: bench/cuda/random_smollm.py).
#
#   bench/cuda/prepare.sh        # then device run: bash bench/cuda/check.sh, carry [".gpu"]
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
mkdir -p .gpu/whl
plat=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for n in 24 27 28 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
ver() { .venv/bin/pip show "$1" | awk '/^Version/{print $2}'; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d .gpu/whl \
  "gguf==$(ver gguf)" "llguidance==$(ver llguidance)"
.venv/bin/python -c "
import json, os, shutil
import torch
from kvserve.models.export import hf_config_dict
from kvserve.models.loader import load_arch
from tests.tiny_models import tiny_tokenizer_dir
shutil.copytree(tiny_tokenizer_dir(), '.gpu/tok', dirs_exist_ok=True)
os.makedirs('.gpu/config', exist_ok=True)
with open('.gpu/config/config.json', 'w') as f:
    json.dump(hf_config_dict(load_arch(None), torch.bfloat16), f, indent=2)"
du -sh .gpu
