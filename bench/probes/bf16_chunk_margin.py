"""The embedded model's first answer token to the demo prompt, per attention path and dtype.

    PYTHONPATH=. .venv/bin/python bench/probes/bf16_chunk_margin.py

The chat prompt "What is the capital of France?" (37 tokens) prefilled in one chunk with
dense weights (``--quantization none``), the chunk attending either through SDPA (chunk
limit 0) or through the native decode kernel (limit 64), in float32 and bfloat16; printed:
the log-probabilities of "The" (504) and "L" (60), the two leading first tokens, and their
margin. The answer is a near-tie in float32, so the path's rounding decides it (session 17:
the engine's default, bf16 with the chunk on the kernel, answers "L'Étoile, ...").
"""

from __future__ import annotations

import torch

from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import default_model_path, load_model
from kvserve.runtime.attention import SeqSpec, build_attention_metadata
from kvserve.tokenizer import Tokenizer

THE, L = 504, 60


def main() -> None:
    torch.set_num_threads(2)
    loaded = load_model(default_model_path(), "float32", "none")
    tok = Tokenizer.from_loaded(loaded.tokenizer_dir, loaded.gguf_file)
    ids = torch.tensor(
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    )
    n = ids.shape[0]
    for dtype in (torch.float32, torch.bfloat16):
        for limit in (0, 64):
            m = LlamaForCausalLM(loaded.arch, attn_backend="native")
            m.load_weights(loaded.state_dict)
            m = m.to(dtype).eval()
            m.attn_backend.chunk_kernel_max_tokens = limit  # type: ignore[attr-defined]
            arch = m.arch
            caches = [
                torch.zeros(2, 8, 16, arch.num_key_value_heads, arch.head_dim, dtype=dtype)
                for _ in range(arch.num_hidden_layers)
            ]
            meta = build_attention_metadata(
                [SeqSpec(0, n, 0, [0, 1, 2])],
                block_size=16,
                device=torch.device("cpu"),
                dtype=dtype,
            )
            with torch.no_grad():
                hidden = m(ids, torch.arange(n), caches, meta)[-1:]
                lp = m.compute_logits(hidden).log_softmax(-1)[0]
            path = "decode kernel" if limit else "SDPA"
            print(
                f"{str(dtype):15s} chunk on {path:13s} The {lp[THE]:.3f}  L {lp[L]:.3f}  "
                f"margin {lp[THE] - lp[L]:+.3f}"
            )


if __name__ == "__main__":
    main()
