"""Mixture-of-experts checkpoints: config fields, tensor names and shapes, stacked experts.

The model (``moe.py``) takes each MoE layer's tensors under one naming, whatever the file:

- ``model.layers.N.mlp.gate.weight`` ``[E, h]``: the router;
- ``model.layers.N.mlp.experts.{e}.{gate,up,down}_proj.weight``: expert ``e``'s SwiGLU MLP
  (``[I, h]``, ``[I, h]``, ``[h, I]``, ``I = moe_intermediate_size``);
- Qwen2-MoE also ``mlp.shared_expert.{gate,up,down}_proj.weight`` (width
  ``shared_expert_intermediate_size``) and ``mlp.shared_expert_gate.weight`` ``[1, h]``.

Files spell them three ways, all read here: per-expert tensors under those names (Qwen-MoE
checkpoints on the Hub, and transformers 5's ``save_pretrained``), Mixtral's
``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate, up, down), and stacked 3-D tensors: transformers
5's ``mlp.experts.gate_up_proj`` ``[E, 2I, h]`` / ``mlp.experts.down_proj`` ``[E, h, I]``
(``save_pretrained(save_original_format=False)``), llama.cpp's ``ffn_{gate,up,down}_exps``
(read as ``mlp.experts.{gate,up,down}_proj``). ``unstack_experts`` splits a stacked tensor
into the per-expert ones (views, no copy).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from kvserve.config import ModelArchConfig
from kvserve.models.errors import ModelLoadError, positive_int

# Our architecture names of the MoE families.
MOE_ARCHS = ("mixtral", "qwen2moe", "qwen3moe")
# Router weights: kept dense in fp32 whatever the file or --quantization (as llama.cpp's
# quantize keeps ffn_gate_inp in F32).
ROUTER_SUFFIXES = (".mlp.gate.weight", ".mlp.shared_expert_gate.weight")
# Stacked expert tensors (one per MoE layer) -> the per-expert projections they hold.
_STACKED_RE = re.compile(
    r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)"
)
_MIXTRAL_RE = re.compile(
    r"(model\.layers\.\d+\.)block_sparse_moe\.(gate|experts\.\d+\.w[123])\.weight"
)
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def hf_moe_fields(config: dict[str, Any], arch: str, path: str) -> dict[str, Any]:
    """The MoE fields of ``ModelArchConfig`` from an HF config.json ({} for a dense family).

    ModelLoadError naming ``path`` and the key for a missing or inconsistent value.
    """
    if arch not in MOE_ARCHS:
        return {}
    # NOTE: transformers 5 saves Qwen3-MoE's num_experts as num_local_experts (its
    # attribute_map); Hub checkpoints spell it num_experts.
    experts_key = "num_local_experts" if arch == "mixtral" else "num_experts"
    if config.get(experts_key) is None and config.get("num_local_experts") is not None:
        experts_key = "num_local_experts"

    def req(key: str) -> int:
        if config.get(key) is None:
            raise ModelLoadError(f"{path}: required key {key!r} is missing")
        return positive_int(config[key], key, path)

    num_experts, top_k = req(experts_key), req("num_experts_per_tok")
    if top_k > num_experts:
        raise ModelLoadError(
            f"{path}: 'num_experts_per_tok' ({top_k}) exceeds {experts_key!r} ({num_experts})"
        )
    if arch == "mixtral":  # every layer routed, renormalized top-k, experts of intermediate_size
        return {
            "num_experts": num_experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": req("intermediate_size"),
            "norm_topk_prob": True,
        }
    step = req("decoder_sparse_step") if config.get("decoder_sparse_step") is not None else 1
    only = config.get("mlp_only_layers") or []
    layers = int(config.get("num_hidden_layers") or 0)
    if not isinstance(only, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in only
    ):
        raise ModelLoadError(
            f"{path}: 'mlp_only_layers' must list layer indices in [0, {layers}), got {only!r}"
        )
    shared = 0
    if arch == "qwen2moe":
        shared = req("shared_expert_intermediate_size")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": req("moe_intermediate_size"),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": shared,
        "decoder_sparse_step": step,
        "mlp_only_layers": tuple(sorted(set(only))),
    }


def gguf_moe_fields(
    md: dict[str, Any], gguf_arch: str, layer_names: set[str], num_layers: int, path: str
) -> dict[str, Any]:
    """The MoE fields from GGUF metadata (``{arch}.expert_count`` and friends) and the layers
    that hold expert tensors (``layer_names``: ``blk.N.<name>`` of the file); {} when the
    file has no experts. llama.cpp's ``llama`` with experts is Mixtral."""
    count = md.get(f"{gguf_arch}.expert_count")
    if not count:
        if gguf_arch in ("qwen2moe", "qwen3moe"):
            raise ModelLoadError(f"{path}: GGUF metadata key '{gguf_arch}.expert_count' is missing")
        return {}
    num_experts = positive_int(count, f"{gguf_arch}.expert_count", path)
    key = f"{gguf_arch}.expert_used_count"
    if key not in md:
        raise ModelLoadError(f"{path}: GGUF metadata key {key!r} is missing")
    top_k = positive_int(md[key], key, path)
    if top_k > num_experts:
        raise ModelLoadError(
            f"{path}: {key!r} ({top_k}) exceeds '{gguf_arch}.expert_count' ({num_experts})"
        )
    width_key = f"{gguf_arch}.expert_feed_forward_length"
    width = md.get(width_key, md.get(f"{gguf_arch}.feed_forward_length"))
    # NOTE: llama.cpp normalizes the top-k weights for llama (Mixtral) and qwen3moe, not for
    # qwen2moe, unless the file says (``expert_weights_norm``).
    norm = md.get(f"{gguf_arch}.expert_weights_norm", gguf_arch != "qwen2moe")
    shared_key = f"{gguf_arch}.expert_shared_feed_forward_length"
    shared = md.get(shared_key)
    dense = tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in layer_names)
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": positive_int(width, width_key, path),
        "norm_topk_prob": bool(norm),
        "shared_expert_intermediate_size": positive_int(shared, shared_key, path) if shared else 0,
        "mlp_only_layers": dense,
    }


def moe_layer_shapes(arch: ModelArchConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The tensors of one MoE layer's MLP (``prefix``: ``model.layers.N.``) with shapes."""
    h, i = arch.hidden_size, arch.moe_intermediate_size
    p = prefix + "mlp."
    shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (arch.num_experts, h)}
    for e in range(arch.num_experts):
        shapes[f"{p}experts.{e}.gate_proj.weight"] = (i, h)
        shapes[f"{p}experts.{e}.up_proj.weight"] = (i, h)
        shapes[f"{p}experts.{e}.down_proj.weight"] = (h, i)
    s = arch.shared_expert_intermediate_size
    if s:
        shapes[p + "shared_expert.gate_proj.weight"] = (s, h)
        shapes[p + "shared_expert.up_proj.weight"] = (s, h)
        shapes[p + "shared_expert.down_proj.weight"] = (h, s)
        shapes[p + "shared_expert_gate.weight"] = (1, h)
    return shapes


def canonical_name(name: str) -> str:
    """``name`` under the model's naming: Mixtral's ``block_sparse_moe`` tensors renamed
    (``experts.{e}.w1`` -> ``mlp.experts.{e}.gate_proj``), any other name unchanged."""
    match = _MIXTRAL_RE.fullmatch(name)
    if match is None:
        return name
    rest = match.group(2)
    if rest != "gate":
        _, e, w = rest.split(".")
        rest = f"experts.{e}.{_MIXTRAL_PROJ[w]}"
    return f"{match.group(1)}mlp.{rest}.weight"


def is_stacked(name: str) -> bool:
    """Whether ``name`` is a stacked 3-D expert tensor (see the module docstring)."""
    return _STACKED_RE.fullmatch(name) is not None


def check_stacked(
    name: str, shape: tuple[int, ...], arch: ModelArchConfig, path: str, label: str | None = None
) -> None:
    """ModelLoadError naming ``path`` and the tensor unless it is a stacked expert tensor of
    a MoE layer with the shape the config implies."""
    match = _STACKED_RE.fullmatch(name)
    label = label or repr(name)
    layer = int(name.split(".")[2]) if match else -1
    if match is None or not 0 <= layer < arch.num_hidden_layers or not arch.is_moe_layer(layer):
        raise ModelLoadError(f"{path}: unexpected tensor {label} for this architecture")
    e, h, i = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size
    want = {
        "gate_up_proj": (e, 2 * i, h),
        "gate_proj": (e, i, h),
        "up_proj": (e, i, h),
        "down_proj": (e, h, i),
    }[match.group(2)]
    if tuple(shape) != want:
        raise ModelLoadError(
            f"{path}: tensor {label} has shape {list(shape)}, but the config implies {list(want)}"
        )


def stacked_names(name: str, arch: ModelArchConfig) -> list[str]:
    """The per-expert names stacked tensor ``name`` gives (``unstack_experts``)."""
    base, kind = _STACKED_RE.fullmatch(name).groups()  # type: ignore[union-attr]
    kinds = ["gate_proj", "up_proj"] if kind == "gate_up_proj" else [kind]
    return [f"{base}.{e}.{k}.weight" for e in range(arch.num_experts) for k in kinds]


def unstack_experts(name: str, experts: list[Any], arch: ModelArchConfig) -> dict[str, Any]:
    """The per-expert tensors of stacked tensor ``name``, given its experts' 2-D slices in
    order (dense views or ``QuantizedWeight``s); a fused ``gate_up_proj`` split by rows."""
    match = _STACKED_RE.fullmatch(name)
    assert match is not None, name
    base, kind = match.groups()
    out: dict[str, Any] = {}
    for e, tensor in enumerate(experts):
        p = f"{base}.{e}."
        if kind == "gate_up_proj":
            i = arch.moe_intermediate_size
            gate, up = (
                torch.split(tensor, [i, i])
                if isinstance(tensor, torch.Tensor)
                else tensor.split_rows([i, i])
            )
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = gate, up
        else:
            out[p + kind + ".weight"] = tensor
    return out


def is_router(name: str) -> bool:
    """Whether ``name`` is a router weight (kept dense; see ``ROUTER_SUFFIXES``)."""
    return name.endswith(ROUTER_SUFFIXES)


def hf_moe_config(arch: ModelArchConfig) -> dict[str, Any]:
    """The MoE keys of an HF config.json for ``arch`` ({} for a dense model): what
    ``hf_moe_fields`` reads back."""
    if not arch.num_experts:
        return {}
    top_k = arch.num_experts_per_tok
    if arch.architecture == "mixtral":
        return {"num_local_experts": arch.num_experts, "num_experts_per_tok": top_k}
    out: dict[str, Any] = {
        "num_experts": arch.num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": arch.moe_intermediate_size,
        "norm_topk_prob": arch.norm_topk_prob,
        "decoder_sparse_step": arch.decoder_sparse_step,
        "mlp_only_layers": list(arch.mlp_only_layers),
    }
    if arch.architecture == "qwen2moe":
        out["shared_expert_intermediate_size"] = arch.shared_expert_intermediate_size
        out["qkv_bias"] = arch.attention_bias
    return out


def checkpoint_names(state_dict: dict[str, Any], arch: ModelArchConfig) -> dict[str, Any]:
    """``state_dict`` under the names a checkpoint of the family holds: Mixtral's experts as
    ``block_sparse_moe.experts.{e}.w1/w3/w2`` (the inverse of ``canonical_name``)."""
    if arch.architecture != "mixtral":
        return state_dict
    inverse = {v: k for k, v in _MIXTRAL_PROJ.items()}
    out: dict[str, Any] = {}
    for name, tensor in state_dict.items():
        match = re.fullmatch(r"(model\.layers\.\d+\.)mlp\.(gate|experts\.\d+\.\w+)\.weight", name)
        if match is None:
            out[name] = tensor
            continue
        rest = match.group(2)
        if rest != "gate":
            _, e, proj = rest.split(".")
            rest = f"experts.{e}.{inverse[proj]}"
        out[f"{match.group(1)}block_sparse_moe.{rest}.weight"] = tensor
    return out
