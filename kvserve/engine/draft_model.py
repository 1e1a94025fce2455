"""Speculative decoding's draft model at start-up: found, loaded, checked, budgeted, attached.

``speculative_config={"model": PATH, ...}`` (vLLM's form). What the start-up does with it:

- ``resolve_draft_source``: the path as a local file or folder (a Hub id through the cache,
  as the target's), else a ValueError naming ``speculative_config.model``.
- ``load_draft``: the draft loads as the target does (``load_engine_model``: its kernels,
  the target's final dtype and quantization), then must share the target's vocabulary and
  tokenizer (``check_draft_matches``: ValueError naming the field that differs). A draft
  whose layers mix full and sliding attention is refused (the hybrid KV cache has no draft
  rows), as is one shorter than ``max_model_len``.
- Budget: the draft's KV shares the target's block ids (``runtime/draft_runner.py``), so a
  block's bytes are the target's plus the draft's (``draft_kv_bytes_per_token``): the pool,
  admission and every capacity figure count it. Its weights count as weights
  (``with_draft_weights``) and its activation plan as activations.
- ``draft_token_cost``: the cost model's price of a draft token when the config leaves it
  out (module NOTE below).
- ``attach_draft``: the ``DraftRunner`` beside the runner, with the pool's block counts.
"""

from __future__ import annotations

import dataclasses
import os

from kvserve.engine.config import EngineConfig
from kvserve.engine.memory_budget import MemoryReport, plan_step_activations
from kvserve.engine.startup import (
    EngineModel,
    choose_kernels,
    load_engine_model,
    warm_kernel_primitives,
)
from kvserve.models.loader import resolve_model
from kvserve.models.quant_model import decode_weight_bytes, quantized_decode_bytes
from kvserve.runtime.draft_runner import DraftRunner
from kvserve.runtime.kv_cache import kv_bytes_per_token
from kvserve.spec_config import DEFAULT_DRAFT_TOKEN_COST

FIELD = "speculative_config.model"


def resolve_draft_source(config: EngineConfig) -> EngineConfig:
    """``config`` with its draft model as a local path (unchanged without one); a missing
    path is a ValueError naming ``speculative_config.model``."""
    spec = config.speculative_config
    if spec is None or spec.model is None:
        return config
    try:
        path = resolve_model(spec.model)
    except (ValueError, OSError) as e:
        raise ValueError(f"{FIELD}={spec.model!r}: {e}") from e
    return config.replace(speculative_config=dataclasses.replace(spec, model=path))


def load_draft(config: EngineConfig, target: EngineModel, max_model_len: int) -> EngineModel | None:
    """The draft model, loaded as the target is and checked against it (module docstring);
    None without one."""
    spec = config.speculative_config
    if spec is None or spec.model is None:
        return None
    draft_config = config.replace(model=spec.model, speculative_config=None)
    try:
        draft = load_engine_model(draft_config, choose_kernels(draft_config))
    except ValueError as e:
        raise ValueError(f"{FIELD}={spec.model!r} does not load: {e}") from e
    check_draft_matches(target, draft, spec.model, max_model_len)
    return draft


def check_draft_matches(
    target: EngineModel, draft: EngineModel, path: str, max_model_len: int
) -> None:
    """ValueError naming what differs when ``draft`` cannot propose tokens for ``target``:
    vocabulary size, tokenizer (size, special ids, vocabulary), attention kind, length."""
    where = f"{FIELD}={os.path.basename(path)!r}"
    ta, da = target.arch, draft.arch
    if da.vocab_size != ta.vocab_size:
        raise ValueError(
            f"{where}: the draft model's vocab_size {da.vocab_size} differs from the target's "
            f"{ta.vocab_size} (a draft model must share the target's vocabulary)"
        )
    tt, dt = target.tokenizer, draft.tokenizer
    for name, get in (
        ("vocab_size", lambda t: t.vocab_size),
        ("bos_token_id", lambda t: t.bos_token_id),
        ("eos_token_id", lambda t: t.eos_token_id),
        ("all_special_ids", lambda t: sorted(t.all_special_ids)),
    ):
        if get(dt) != get(tt):
            raise ValueError(
                f"{where}: the draft model's tokenizer {name} {get(dt)!r} differs from the "
                f"target's {get(tt)!r} (a draft model must share the target's tokenizer)"
            )
    if dt.hf_tokenizer.get_vocab() != tt.hf_tokenizer.get_vocab():
        raise ValueError(
            f"{where}: the draft model's tokenizer maps tokens to other ids than the "
            "target's (a draft model must share the target's tokenizer)"
        )
    if len(set(da.layer_types or ())) > 1 and da.sliding_window is not None:
        raise ValueError(
            f"{where}: a draft model whose layers mix full and sliding attention is not "
            "supported (the hybrid KV cache)"
        )
    if da.max_position_embeddings < max_model_len:
        raise ValueError(
            f"{where}: the draft model's context length {da.max_position_embeddings} is "
            f"shorter than max_model_len {max_model_len}"
        )


def draft_kv_bytes_per_token(config: EngineConfig, draft: EngineModel | None) -> int:
    """The draft's KV bytes per token (every layer, K and V, scales), held in each block
    beside the target's; 0 without a draft."""
    if draft is None:
        return 0
    return kv_bytes_per_token(
        num_layers=draft.arch.num_hidden_layers,
        num_kv_heads=draft.arch.num_key_value_heads,
        head_dim=draft.arch.head_dim,
        kv_cache_dtype=config.kv_cache_dtype,
        dtype=draft.dtype,
    )


def with_draft_weights(target: EngineModel, draft: EngineModel | None) -> EngineModel:
    """``target`` whose weight figures count the draft's weights too (for the budget)."""
    if draft is None:
        return target
    return dataclasses.replace(
        target,
        weights_bytes=target.weights_bytes + draft.weights_bytes,
        packed_weights_bytes=target.packed_weights_bytes + draft.packed_weights_bytes,
    )


def draft_activation_bytes(
    config: EngineConfig, draft: EngineModel | None, max_model_len: int
) -> int:
    """The draft's own activation arena (its forwards run the step's tokens, as the
    target's do): the plan of the largest step for its shapes; 0 without a draft."""
    if draft is None:
        return 0
    return plan_step_activations(config, draft.arch, max_model_len=max_model_len).reserve_bytes


def draft_token_cost(target: EngineModel, draft: EngineModel) -> float:
    """The cost model's price of one draft token (fraction of a target decode step at batch
    1): verifying it (``DEFAULT_DRAFT_TOKEN_COST``) plus one draft decode step, estimated as
    the ratio of the weight bytes a decode step of each reads; at most 1.

    NOTE: measured (docs/speculative.md, "Draft model"): timed against one decode step of its
    target, a draft step took about what this ratio says (the table there); a decode step at
    batch 1 streams the weights, so their bytes set its time.
    """

    def step_bytes(m: EngineModel) -> int:
        return decode_weight_bytes(m.model) + quantized_decode_bytes(m.model)

    return min(1.0, DEFAULT_DRAFT_TOKEN_COST + step_bytes(draft) / max(1, step_bytes(target)))


def with_draft_cost(
    config: EngineConfig, target: EngineModel, draft: EngineModel | None
) -> EngineConfig:
    """``config`` with the draft model's ``draft_token_cost`` set where the user left it out."""
    spec = config.speculative_config
    if draft is None or spec is None or spec.draft_token_cost is not None:
        return config
    cost = round(draft_token_cost(target, draft), 3)
    return config.replace(speculative_config=dataclasses.replace(spec, draft_token_cost=cost))


def attach_draft(
    runner: object, draft: EngineModel | None, config: EngineConfig, report: MemoryReport
) -> None:
    """Give ``runner`` (a ``ModelRunner``) its ``DraftRunner``: the draft model and its KV
    cache over the same block ids (``report``'s device and host blocks), its kernels warm."""
    if draft is None:
        return
    runner.draft = DraftRunner(  # type: ignore[attr-defined]
        draft.model,
        draft.arch,
        num_blocks=report.num_kv_blocks,
        block_size=config.block_size,
        num_host_blocks=report.num_host_blocks,
        device=runner.device,  # type: ignore[attr-defined]
        dtype=draft.dtype,
        kv_cache_dtype=config.kv_cache_dtype,
    )
    # NOTE: its projections' row-bucket primitives too, so RSS stays flat while serving.
    warm_kernel_primitives(config, runner.draft)  # type: ignore[attr-defined, arg-type]
