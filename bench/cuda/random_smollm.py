"""Writes a SmolLM2-135M-shaped Llama with random bf16 weights and the given tokenizer files.

    python bench/cuda/random_smollm.py OUT_DIR TOKENIZER_DIR

For speed figures where the embedded GGUF cannot travel (a GPU machine): the same shapes and
so the same work per token as the real model; the generated text is noise.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig


def main(out: Path, tokenizer_dir: Path) -> None:
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    print("model at", out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
