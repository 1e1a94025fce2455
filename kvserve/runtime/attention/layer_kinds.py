"""The step's attention metadata as each kind of layer reads it (per-layer windows, Gemma).

A model whose layers differ in attention (Gemma 2 / 3: sliding-window layers beside
full-attention ones; an attention scale of its own; soft-capped scores) reads one
``AttentionMetadata`` per kind of layer: ``layer_metadata`` derives them from the step's
(built by the runner for what every layer shares: the KV cache's own window and sinks),
once per step, and every layer of a kind shares its one. A layer kind that reads the step's
metadata unchanged gets that very object, so a model with uniform layers pays nothing.

With the hybrid KV cache (``core/kv/hybrid.py``: layers grouped by window, each group its
own block tables) each layer starts from its group's metadata instead
(``group_layer_metadata``); without it (a window the cache cannot use, an option the hybrid
cache does not take) the cache is uniform and a sliding layer only masks what lies outside
its window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvserve.config import ModelArchConfig
from kvserve.runtime.attention.metadata import AttentionMetadata, build_attention_metadata


def reads_step_metadata(arch: ModelArchConfig) -> bool:
    """Whether every layer of ``arch`` reads the step's metadata unchanged (one window for
    all, the default scale, no soft cap): what steps captured once and replayed (CUDA
    graphs) rely on."""
    return (
        (arch.layer_types is None or arch.shared_window == arch.sliding_window)
        and arch.default_attention_scale
        and arch.attn_logit_softcapping is None
    )


def tighter_window(a: int | None, b: int | None) -> int | None:
    """The narrower of two windows (None: no window)."""
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def kind_metadata(
    meta: AttentionMetadata,
    window: int | None,
    scale: float | None,
    logit_softcap: float | None,
) -> AttentionMetadata:
    """``meta`` as a layer with its own ``window`` (None: none), attention ``scale`` and
    score ``logit_softcap`` reads it; ``meta`` itself where nothing differs.

    The window read is the tighter of the layer's and the step's (the KV cache's window,
    whose sink tokens stay visible only where it is the tighter one).
    """
    effective = tighter_window(window, meta.sliding_window)
    base = meta
    if effective != meta.sliding_window:
        base = build_attention_metadata(
            meta.seqs,
            block_size=meta.block_size,
            device=meta.slot_mapping.device,
            dtype=meta.dtype,
            sliding_window=effective,
        )
    if base.scale == scale and base.logit_softcap == logit_softcap:
        return base
    # NOTE: a fresh plans dict: a backend's plan may depend on what differs here.
    return dataclasses.replace(base, scale=scale, logit_softcap=logit_softcap, backend_plans={})


def layer_metadata(
    meta: AttentionMetadata,
    windows: Sequence[int | None],
    scale: float | None = None,
    logit_softcap: float | None = None,
) -> list[AttentionMetadata]:
    """One metadata per layer (``windows[i]``: layer i's own window), shared by the layers
    of one window: ``kind_metadata`` of each distinct window, made once."""
    return group_layer_metadata([meta] * len(windows), windows, scale, logit_softcap)


def group_layer_metadata(
    group_metas: Sequence[AttentionMetadata],
    windows: Sequence[int | None],
    scale: float | None = None,
    logit_softcap: float | None = None,
) -> list[AttentionMetadata]:
    """``layer_metadata`` under the hybrid KV cache: layer i reads ``group_metas[i]`` (its
    group's tables, built with the group's window) as its kind reads it; made once per
    distinct (group metadata, window)."""
    kinds: dict[tuple[int, int | None], AttentionMetadata] = {}
    out = []
    for meta, window in zip(group_metas, windows, strict=True):
        key = (id(meta), window)
        m = kinds.get(key)
        if m is None:
            m = kinds[key] = kind_metadata(meta, window, scale, logit_softcap)
        out.append(m)
    return out
