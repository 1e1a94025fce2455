"""Model shapes for the simulator: built-in presets or an HF ``config.json``.

Only shapes matter here (no weights): they give the parameter count (weight bytes to stream,
FLOPs per token) and the KV cache footprint per token, by the seed's formula
``2 x layers x kv_heads x head_dim x bytes_per_element``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from kvserve.config import ModelArchConfig

DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "int8": 1,
    "fp8": 1,
    "float8_e4m3fn": 1,
}


def dtype_bytes(name: str) -> float:
    """Bytes per element of a dtype name ('float16', 'bf16', 'int8', ...)."""
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r}; expected one of {sorted(set(DTYPE_BYTES))}"
        ) from None


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only transformer (Llama family, optionally MoE MLPs).

    ``num_experts`` > 1 makes the MLP a mixture of experts of which ``num_experts_per_tok``
    are active per token (Mixtral): all experts count for memory, only active ones for FLOPs.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 8192
    num_experts: int = 1
    num_experts_per_tok: int = 1
    tie_word_embeddings: bool = False
    dtype: str = "float16"  # weights and activations
    kv_dtype: str | None = None  # None = same as dtype

    def __post_init__(self) -> None:
        for f in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "num_experts",
            "num_experts_per_tok",
        ):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ModelSpec.{f} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelSpec.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError("ModelSpec.num_experts_per_tok must be <= num_experts")
        dtype_bytes(self.dtype)
        if self.kv_dtype is not None:
            dtype_bytes(self.kv_dtype)

    # --- bytes -------------------------------------------------------------------------
    @property
    def dtype_bytes(self) -> float:
        return dtype_bytes(self.dtype)

    @property
    def kv_dtype_bytes(self) -> float:
        return dtype_bytes(self.kv_dtype or self.dtype)

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """2 (K and V) x kv_heads x head_dim x bytes per element."""
        return int(2 * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        """The seed's formula across all layers: 2 x layers x kv_heads x head_dim x bytes."""
        return self.num_layers * self.kv_bytes_per_token_per_layer

    def kv_bytes(self, num_tokens: int, batch_size: int = 1) -> int:
        """KV cache bytes for ``batch_size`` sequences of ``num_tokens`` each."""
        return batch_size * num_tokens * self.kv_bytes_per_token

    # --- parameters --------------------------------------------------------------------
    @property
    def attn_params_per_layer(self) -> int:
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        # q, k, v, o projections (no biases: Llama family)
        return self.hidden_size * (q_out + 2 * kv_out) + q_out * self.hidden_size

    @property
    def expert_params(self) -> int:
        """One gated MLP (gate, up, down)."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def router_params_per_layer(self) -> int:
        return self.hidden_size * self.num_experts if self.num_experts > 1 else 0

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Parameters of the output projection (shared with the embedding when tied)."""
        return self.vocab_size * self.hidden_size

    def layer_params(self, num_active_experts: float | None = None) -> float:
        """Parameters of one layer; ``num_active_experts`` defaults to all experts."""
        experts = self.num_experts if num_active_experts is None else num_active_experts
        norms = 2 * self.hidden_size
        return (
            self.attn_params_per_layer
            + experts * self.expert_params
            + self.router_params_per_layer
            + norms
        )

    @property
    def num_params(self) -> int:
        """Total parameters (all experts, embedding, untied lm_head, norms)."""
        body = self.num_layers * self.layer_params()
        head = 0 if self.tie_word_embeddings else self.lm_head_params
        return int(body + self.embedding_params + head + self.hidden_size)

    @property
    def num_active_params(self) -> int:
        """Parameters one token passes through (only ``num_experts_per_tok`` experts)."""
        body = self.num_layers * self.layer_params(self.num_experts_per_tok)
        head = 0 if self.tie_word_embeddings else self.lm_head_params
        return int(body + self.embedding_params + head + self.hidden_size)

    @property
    def weight_bytes(self) -> int:
        return int(self.num_params * self.dtype_bytes)

    def with_dtype(self, dtype: str, kv_dtype: str | None = None) -> ModelSpec:
        """A copy with other weight / KV dtypes (validated)."""
        return replace(self, dtype=dtype, kv_dtype=kv_dtype)

    def to_arch_config(self) -> ModelArchConfig:
        """The engine's ModelArchConfig for the same shapes (MoE is not representable there)."""
        return ModelArchConfig(
            architecture="llama",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
        )


def _llama(name: str, **kw: object) -> ModelSpec:
    return ModelSpec(name=name, **kw)  # type: ignore[arg-type]


# NOTE: shapes are those of the published config.json files of these models.
PRESETS: dict[str, ModelSpec] = {
    "llama-3-8b": _llama(
        "Llama-3-8B",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
    ),
    "llama-3-70b": _llama(
        "Llama-3-70B",
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
        max_position_embeddings=8192,
    ),
    "mixtral-8x7b": _llama(
        "Mixtral-8x7B",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=32000,
        max_position_embeddings=32768,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "smollm2-135m": _llama(
        "SmolLM2-135M",
        num_layers=30,
        hidden_size=576,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        dtype="float32",
    ),
}


def model_from_hf_config(
    config: dict, name: str = "hf-model", dtype: str | None = None
) -> ModelSpec:
    """A ModelSpec from the dict of an HF ``config.json`` (Llama / Mistral / Qwen2 / Mixtral).

    ``dtype`` overrides the config's ``torch_dtype`` (default float16 when absent).
    """
    required = (
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
    )
    missing = [k for k in required if k not in config]
    if missing:
        raise ValueError(f"HF config lacks required keys: {', '.join(missing)}")
    num_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = config.get("head_dim") or hidden // num_heads
    cfg_dtype = config.get("torch_dtype") or config.get("dtype") or "float16"
    num_experts = int(config.get("num_local_experts") or config.get("num_experts") or 1)
    return ModelSpec(
        name=name,
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        intermediate_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings") or 8192),
        num_experts=num_experts,
        num_experts_per_tok=int(config.get("num_experts_per_tok") or 1) if num_experts > 1 else 1,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        dtype=dtype or str(cfg_dtype),
    )


def get_model_spec(name_or_path: str, dtype: str | None = None) -> ModelSpec:
    """A preset by name (case-insensitive), or a ``config.json`` file / a directory holding one."""
    key = name_or_path.lower()
    if key in PRESETS:
        spec = PRESETS[key]
        return spec.with_dtype(dtype) if dtype else spec
    path = name_or_path
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"unknown model {name_or_path!r}: not a preset ({', '.join(PRESETS)}) "
            "and not a config.json file or a directory holding one"
        )
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    base = os.path.basename(os.path.dirname(os.path.abspath(path))) or "hf-model"
    return model_from_hf_config(config, name=base, dtype=dtype)
