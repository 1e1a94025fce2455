"""KV cache groups of a hybrid model: layers grouped by attention type (full or window W).

A model whose layers mix full attention and a sliding window (Gemma 2/3, Qwen2 with
``max_window_layers``, HF's ``layer_types``) gets one *group* per run of layers that read
the same tokens: each group keeps its own block tables over one shared block pool
(``HybridKVCacheManager``). A sliding group needs only the blocks its window reads.

Grouping mirrors vLLM v1's uniform-page-size grouping (``kv_cache_utils``): every group
holds the same number of layers (``group_size``, the smallest type's layer count, or the
largest when that is within 1.25x and so needs no padding), so one block id stands for
``group_size`` layers' K/V of ``block_size`` tokens whatever group owns it. The runtime
keeps ``group_size`` KV tensors of ``num_blocks`` blocks; layer ``layers[j]`` of every
group reads and writes tensor ``j`` (``kv_slot_of_layers``). A type whose layer count is
not a multiple of ``group_size`` gets a last, smaller group (its unused slot is padding).

Torch-free: the engine, the runner and the capacity figures share these functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


@dataclass(frozen=True, slots=True)
class KVGroupSpec:
    """One KV cache group: its layers and its window (None: full attention)."""

    layers: tuple[int, ...]
    window: int | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a KV cache group needs at least one layer")
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(
                f"a sliding group's window must be a positive int, got {self.window!r}"
            )

    @property
    def is_sliding(self) -> bool:
        return self.window is not None


def check_layer_types(
    layer_types: Sequence[str], num_layers: int, sliding_window: int | None
) -> None:
    """ValueError naming what is wrong with a model's ``layer_types``."""
    if len(layer_types) != num_layers:
        raise ValueError(
            f"layer_types has {len(layer_types)} entries but the model has {num_layers} layers"
        )
    bad = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if bad:
        raise ValueError(f"unknown layer_types {bad}; each must be one of {list(LAYER_TYPES)}")
    if SLIDING_ATTENTION in layer_types and (sliding_window is None or sliding_window < 1):
        raise ValueError("layer_types has sliding_attention layers but no sliding_window is set")


def group_layers(layer_types: Sequence[str], sliding_window: int | None) -> tuple[KVGroupSpec, ...]:
    """The KV cache groups of a model's layers, full-attention groups first.

    Every group holds ``group_size`` layers (see the module docstring) except possibly the
    last of a type. Raises ValueError for an unknown type or a sliding layer without window.
    """
    check_layer_types(layer_types, len(layer_types), sliding_window)
    by_type: dict[str, list[int]] = {t: [] for t in LAYER_TYPES}
    for i, t in enumerate(layer_types):
        by_type[t].append(i)
    present = [(t, layers) for t, layers in by_type.items() if layers]
    counts = [len(layers) for _, layers in present]
    size = min(counts)
    # NOTE: vLLM's rule: a group as large as the largest type when that pads < 25%.
    if max(counts) < size * 1.25:
        size = max(counts)
    groups = []
    for t, layers in present:
        window = sliding_window if t == SLIDING_ATTENTION else None
        for i in range(0, len(layers), size):
            groups.append(KVGroupSpec(tuple(layers[i : i + size]), window))
    return tuple(groups)


def group_size(groups: Sequence[KVGroupSpec]) -> int:
    """Layers one block id stands for: the largest group's layer count."""
    return max(len(g.layers) for g in groups)


def kv_slot_of_layers(groups: Sequence[KVGroupSpec], num_layers: int) -> list[int]:
    """The KV tensor (slot) each layer uses: its index within its group."""
    slots = [-1] * num_layers
    for g in groups:
        for j, layer in enumerate(g.layers):
            slots[layer] = j
    if -1 in slots:
        raise ValueError(f"layer {slots.index(-1)} is in no KV cache group")
    return slots


def group_of_layers(groups: Sequence[KVGroupSpec], num_layers: int) -> list[int]:
    """The group index of each layer."""
    out = [-1] * num_layers
    for gi, g in enumerate(groups):
        for layer in g.layers:
            out[layer] = gi
    if -1 in out:
        raise ValueError(f"layer {out.index(-1)} is in no KV cache group")
    return out


def window_blocks(window: int, block_size: int, num_new_tokens: int = 1) -> int:
    """The most blocks a sliding group's table holds live while it computes
    ``num_new_tokens`` tokens: those of the ``window - 1`` keys before them and of the new
    tokens, plus one block of misalignment (``ceil(W / block_size) + 1`` for a decode)."""
    return -(-(window - 1 + num_new_tokens) // block_size) + 1


def hybrid_blocks_per_request(
    groups: Sequence[KVGroupSpec], block_size: int, num_tokens: int, max_chunk: int = 1
) -> int:
    """Block ids one request of ``num_tokens`` tokens holds at most, over every group: all of
    its blocks per full group, at most ``window_blocks`` per sliding group (chunks of at
    most ``max_chunk`` tokens)."""
    every = -(-num_tokens // block_size)
    total = 0
    for g in groups:
        if g.window is None:
            total += every
        else:
            total += min(every, window_blocks(g.window, block_size, max(1, max_chunk)))
    return total
