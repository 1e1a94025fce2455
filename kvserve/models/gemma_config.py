"""Gemma 2 / Gemma 3 (text) configs -> the ``ModelArchConfig`` fields that set them apart.

Read from an HF ``config.json`` (``gemma_hf_fields``) or from GGUF metadata as llama.cpp's
converter writes it (``gemma_gguf_fields``). A key a config leaves out takes the default of
transformers' ``Gemma2Config`` / ``Gemma3TextConfig``, as transformers would. An unsupported
setting is a ``ModelLoadError`` (a ValueError) naming the file and the key.

What both families share: RMSNorm weights applied as ``1 + w``, norms of the attention and
MLP outputs besides the usual two, GeGLU (gelu with the tanh approximation), embeddings
times ``sqrt(hidden_size)``, an attention scale of ``query_pre_attn_scalar ** -0.5``, and
layers of two kinds (``layer_types``): sliding-window and full attention. Gemma 2 adds soft
caps of the attention scores and of the final logits; Gemma 3 per-head q/k norms and a
RoPE base of its own for the sliding layers (default RoPE there; any scaling applies to the
full layers only, as in transformers and llama.cpp).
"""

from __future__ import annotations

from typing import Any

from kvserve.config import LAYER_TYPES, ModelArchConfig
from kvserve.models.errors import ModelLoadError

GEMMA_ARCHS = ("gemma2", "gemma3")

# transformers' defaults (Gemma2Config, Gemma3TextConfig) for keys a config may leave out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {
        "sliding_window": 4096,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "rope_theta": 10000.0,
        "rope_local_base_freq": None,
    },
    "gemma3": {
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
    },
}
GELU_TANH = "gelu_pytorch_tanh"


def default_layer_types(arch: str, num_layers: int, pattern: int | None = None) -> tuple[str, ...]:
    """transformers' (and llama.cpp's) layer pattern: of every ``pattern`` layers, all but
    the last slide (Gemma 2: 2, every other layer; Gemma 3: 6, five local to one global)."""
    n = pattern or _DEFAULTS[arch]["sliding_window_pattern"]
    return tuple(
        "sliding_attention" if (i + 1) % n else "full_attention" for i in range(num_layers)
    )


def shared_fields() -> dict[str, Any]:
    """The ``ModelArchConfig`` fields every Gemma 2 / 3 model sets alike."""
    return {
        "hidden_act": GELU_TANH,
        "sandwich_norms": True,
        "norm_weight_offset": 1.0,
        "scale_embeddings": True,
    }


def _value(config: dict[str, Any], key: str, arch: str) -> Any:
    """``config[key]`` (an explicit null stays None), else transformers' default."""
    return config[key] if key in config else _DEFAULTS[arch].get(key)


def _positive(value: Any, key: str, path: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ModelLoadError(f"{path}: {key!r} must be a positive number or null, got {value!r}")
    return float(value)


def gemma_hf_fields(
    config: dict[str, Any], arch: str, num_layers: int, path: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``ModelArchConfig`` fields, the config to read the full layers' RoPE from) of a Gemma
    2 / 3 ``config.json``: the RoPE config has ``rope_theta`` and, if any, ``rope_scaling``,
    from transformers 5's ``rope_parameters`` (per layer type for Gemma 3) or transformers
    4's keys. ModelLoadError naming the key of an unsupported setting."""
    act = config.get("hidden_activation") or config.get("hidden_act") or GELU_TANH
    if act != GELU_TANH:
        raise ModelLoadError(
            f"{path}: hidden_activation {act!r} is not supported on {arch} (only {GELU_TANH!r})"
        )
    if config.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{path}: 'use_bidirectional_attention' true is not supported")
    layer_types = _layer_types(config, arch, num_layers, path)
    window = _value(config, "sliding_window", arch)
    if window is not None:
        window = _positive(window, "sliding_window", path)
    context = config.get("max_position_embeddings")
    if window is not None and isinstance(context, int) and window >= context:
        window = None  # NOTE: a window at or past the context never slides
    # NOTE: the types stay even where no window cuts (or every layer slides): Gemma 3's
    # sliding layers rotate with their own RoPE base all the same.
    rope_config, local_theta = _rope(config, arch, path)
    fields = {
        **shared_fields(),
        "layer_types": layer_types,
        "sliding_window": int(window) if window is not None else None,
        "query_pre_attn_scalar": _positive(
            _value(config, "query_pre_attn_scalar", arch), "query_pre_attn_scalar", path
        ),
        "attn_logit_softcapping": _positive(
            _value(config, "attn_logit_softcapping", arch), "attn_logit_softcapping", path
        ),
        "final_logit_softcapping": _positive(
            _value(config, "final_logit_softcapping", arch), "final_logit_softcapping", path
        ),
        "local_rope_theta": local_theta,
        "qk_norm": arch == "gemma3",
        # NOTE: both config classes tie by default; hub configs often leave the key out.
        "tie_word_embeddings": _tied(config, path),
    }
    return fields, rope_config


def _tied(config: dict[str, Any], path: str) -> bool:
    value = config.get("tie_word_embeddings")
    if value is None:
        return True
    if not isinstance(value, bool):
        raise ModelLoadError(f"{path}: 'tie_word_embeddings' must be true or false, got {value!r}")
    return value


def _layer_types(config: dict[str, Any], arch: str, num_layers: int, path: str) -> tuple[str, ...]:
    types = config.get("layer_types")
    if types is None:
        pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
        if pattern is not None and (isinstance(pattern, bool) or not isinstance(pattern, int)):
            raise ModelLoadError(f"{path}: 'sliding_window_pattern' must be an integer")
        if pattern is not None and pattern < 1:
            raise ModelLoadError(f"{path}: 'sliding_window_pattern' must be >= 1, got {pattern}")
        return default_layer_types(arch, num_layers, pattern)
    if not isinstance(types, list) or len(types) != num_layers:
        raise ModelLoadError(
            f"{path}: 'layer_types' must list one type for each of the {num_layers} layers"
        )
    unknown = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
    if unknown:
        raise ModelLoadError(
            f"{path}: 'layer_types' has unsupported type(s) {unknown} "
            f"(supported: {', '.join(LAYER_TYPES)})"
        )
    return tuple(types)


def _rope(config: dict[str, Any], arch: str, path: str) -> tuple[dict[str, Any], float | None]:
    """(a config holding the full layers' ``rope_theta`` / ``rope_scaling``, the sliding
    layers' base or None)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # transformers 5, Gemma 3
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        kind = local.get("rope_type", local.get("type", "default"))
        if kind != "default":
            raise ModelLoadError(
                f"{path}: 'rope_parameters.sliding_attention' of rope_type {kind!r} is not "
                "supported (only 'default')"
            )
        full_theta = full.pop("rope_theta", _DEFAULTS[arch]["rope_theta"])
        local_theta = local.get("rope_theta", _DEFAULTS[arch]["rope_local_base_freq"])
        rope_config = {"rope_theta": full_theta, "rope_scaling": full or None}
    else:
        flat = dict(params or {})
        theta = config.get("rope_theta", flat.pop("rope_theta", _DEFAULTS[arch]["rope_theta"]))
        scaling = config.get("rope_scaling") or flat or None
        local_theta = _value(config, "rope_local_base_freq", arch)
        rope_config = {"rope_theta": theta, "rope_scaling": scaling}
    if config.get("partial_rotary_factor") is not None:
        rope_config["partial_rotary_factor"] = config["partial_rotary_factor"]
    rope_config["max_position_embeddings"] = config.get("max_position_embeddings")
    if local_theta is not None:
        local_theta = _positive(local_theta, "rope_local_base_freq", path)
    return rope_config, local_theta


def gemma_gguf_fields(
    get: Any, arch: str, num_layers: int, shapes: tuple[int, int, int, int], path: str
) -> dict[str, Any]:
    """The ``ModelArchConfig`` fields of a ``gemma2`` / ``gemma3`` GGUF file; ``get(key)``
    reads ``{arch}.{key}`` (None where absent); ``shapes``: (hidden size, attention heads,
    head size, context length).

    As llama.cpp reads these files: the layer pattern is fixed per architecture (2: every
    other layer slides; 6: five of six) unless ``attention.sliding_window_pattern`` gives
    the period; the attention scale is ``attention.scale`` where stored, else that of the
    27B models (``hidden_size / num_heads``: 46 layers for Gemma 2, 62 for Gemma 3) or
    ``head_dim ** -0.5``; the sliding layers' RoPE base is ``rope.freq_base_swa``, else 10000
    (Gemma 3). llama.cpp's converter stores every norm weight as ``w + 1`` (the loader
    takes 1 off again).
    """
    hidden, num_heads, head_dim, context = shapes
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = get("attention.sliding_window_pattern")
    if pattern is not None and (isinstance(pattern, bool) or not isinstance(pattern, int)):
        raise ModelLoadError(
            f"{path}: GGUF metadata key {key!r}: only a period (an integer) is supported"
        )
    if pattern is not None and pattern < 1:
        raise ModelLoadError(f"{path}: GGUF metadata key {key!r} must be >= 1, got {pattern}")
    layer_types = default_layer_types(arch, num_layers, pattern)
    window = get("attention.sliding_window")
    if window is not None and window >= context:
        window = None  # NOTE: a window at or past the context never slides
    scale = get("attention.scale")
    if scale:
        query_pre_attn_scalar = 1.0 / float(scale) ** 2
        if abs(query_pre_attn_scalar - round(query_pre_attn_scalar)) < 1e-5 * query_pre_attn_scalar:
            # NOTE: the scale is stored in float32; the scalars Gemma configs give are integers.
            query_pre_attn_scalar = float(round(query_pre_attn_scalar))
    else:
        big = num_layers == {"gemma2": 46, "gemma3": 62}[arch]
        query_pre_attn_scalar = float(hidden // num_heads if big else head_dim)
    local_theta = None
    if arch == "gemma3":
        local_theta = float(get("rope.freq_base_swa") or 10_000.0)
    caps = {
        name: float(value) if (value := get(name)) else None
        for name in ("attn_logit_softcapping", "final_logit_softcapping")
    }
    return {
        **shared_fields(),
        "layer_types": layer_types,
        "sliding_window": int(window) if window else None,
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "local_rope_theta": local_theta,
        "qk_norm": arch == "gemma3",
        **caps,
    }


def gemma_hf_config(arch: ModelArchConfig) -> dict[str, Any]:
    """The Gemma keys of an HF ``config.json`` for ``arch`` (what ``gemma_hf_fields``
    reads back; transformers 4 style keys, which transformers 5 converts on load)."""
    layer_types = arch.layer_types or tuple(
        "sliding_attention" if arch.sliding_window else "full_attention"
        for _ in range(arch.num_hidden_layers)
    )
    config: dict[str, Any] = {
        "hidden_act": GELU_TANH,
        "hidden_activation": GELU_TANH,
        # NOTE: transformers' config classes take an integer here (what the family uses).
        "query_pre_attn_scalar": _int_if_whole(arch.query_pre_attn_scalar or arch.head_dim),
        "attn_logit_softcapping": arch.attn_logit_softcapping,
        "final_logit_softcapping": arch.final_logit_softcapping,
        "sliding_window": arch.sliding_window,
        "layer_types": list(layer_types),
        "attention_bias": False,
    }
    if arch.architecture == "gemma3":
        config["rope_local_base_freq"] = (
            arch.local_rope_theta or _DEFAULTS["gemma3"]["rope_local_base_freq"]
        )
    return config


def _int_if_whole(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value
