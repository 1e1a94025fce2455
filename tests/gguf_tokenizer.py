"""The embedded SmolLM2 tokenizer as GGUF metadata, for tiny GGUFs an engine can serve.

``make_tiny_gguf(..., tokenizer=True)`` calls ``add_gguf_tokenizer``: the byte-level BPE of
``tiny_tokenizer_dir()``'s ``tokenizer.json`` (vocabulary, merges, special tokens) written as
llama.cpp's converter writes a "gpt2" tokenizer, so transformers reads it back from the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONTROL, NORMAL = 3, 1  # llama.cpp's token types


def add_gguf_tokenizer(writer: Any, tokenizer_dir: str) -> None:
    """Write the ``tokenizer.ggml.*`` arrays of ``tokenizer_dir``'s tokenizer.json."""
    spec = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    for token in spec.get("added_tokens", []):
        vocab.setdefault(token["content"], token["id"])
    tokens = [""] * (max(vocab.values()) + 1)
    for token, idx in vocab.items():
        tokens[idx] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if t in special else NORMAL for t in tokens])
    writer.add_token_merges(merges)
