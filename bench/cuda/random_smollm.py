"""Writes the embedded model (SmolLM2-135M) with random bf16 weights: its config, its tokenizer.

    python bench/cuda/random_smollm.py OUT_DIR CONFIG_DIR TOKENIZER_DIR

CONFIG_DIR holds the embedded model's HF config.json and TOKENIZER_DIR its tokenizer files
(bench/cuda/prepare.sh writes both from the GGUF). For speed figures where the GGUF cannot
travel (a GPU machine): the same shapes and so the same work per token as the real model;
the generated text is noise.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main(out: Path, config_dir: Path, tokenizer_dir: Path) -> None:
    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    print("model at", out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
