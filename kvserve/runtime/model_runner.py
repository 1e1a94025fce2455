"""ModelRunner: SchedulerOutput -> swaps/copies -> one ragged forward -> logits -> tokens."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
from torch import nn

from kvserve.config import ModelArchConfig
from kvserve.core.kv.kv_groups import KVGroupSpec, group_size, kv_slot_of_layers
from kvserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.runtime.cuda_graphs import (
    DecodeGraphInputs,
    DecodeGraphs,
    graph_buckets,
    is_pure_decode,
)
from kvserve.runtime.draft_runner import DraftRunner
from kvserve.runtime.guard import sample_guarded
from kvserve.runtime.input_batch import InputBatch, build_input_batch
from kvserve.runtime.kv_cache import KVCache
from kvserve.runtime.prompt_logprobs import compute_prompt_logprobs
from kvserve.runtime.sampler import Sampler
from kvserve.runtime.spec_verify import fold_verified
from kvserve.runtime.workspace import Workspace


class ModelRunner:
    """Owns the KV cache tensors and runs one scheduler step at a time.

    ``model``: a causal LM with the ``LlamaForCausalLM`` interface (``forward(input_ids,
    positions, kv_caches, meta, workspace)`` and ``compute_logits(hidden)``).

    ``execute`` carries out, in order: swap-out (device -> host), swap-in (host -> device),
    block copies (copy-on-write), then one forward over all scheduled tokens as a single
    flattened batch, logits only for the rows that sample, and the Sampler.
    """

    def __init__(
        self,
        model: nn.Module,
        arch: ModelArchConfig,
        *,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        kv_cache_dtype: str = "auto",
        kv_window: int | None = None,
        kv_sink_tokens: int = 0,
        kv_groups: tuple[KVGroupSpec, ...] | None = None,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        self.dtype = dtype
        self.arch = arch
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.model = model.to(device=self.device, dtype=dtype)
        # Hybrid KV cache (core/kv/kv_groups.py): one KV tensor per slot of a group, shared by
        # the groups' layers at that slot (a block id belongs to one group at a time).
        self.kv_groups = kv_groups
        num_slots = group_size(kv_groups) if kv_groups else arch.num_hidden_layers
        self.kv_cache = KVCache(
            num_layers=num_slots,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
            num_host_blocks=num_host_blocks,
            device=self.device,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
        )
        self.layer_caches = self.kv_cache.layer_caches
        if kv_groups:
            slots = kv_slot_of_layers(kv_groups, arch.num_hidden_layers)
            self.layer_caches = [self.kv_cache.layer_caches[s] for s in slots]
        # Windowed eviction (StreamingLLM): the last kv_window positions plus the first
        # kv_sink_tokens stay visible; a model's own sliding window is the tighter of the two.
        # NOTE: only a window every layer shares; a layer's own (Gemma's sliding layers) is
        # applied by the model (runtime/attention/layer_kinds.py).
        windows = [w for w in (arch.shared_window, kv_window) if w is not None]
        self.sliding_window = min(windows) if windows else None
        use_sinks = kv_window is not None and self.sliding_window == kv_window
        self.num_sink_tokens = kv_sink_tokens if use_sinks else 0
        self.sampler = Sampler(arch.vocab_size, seed, eos_token_id=arch.eos_token_id)
        # NOTE: activations live in these buffers across steps: once the largest step has run,
        # the forward pass allocates nothing but its output (see kvserve.bench.hotpath).
        self.workspace = Workspace()
        self.graphs: DecodeGraphs | None = None  # captured decode steps (CUDA, triton)
        # Speculative decoding's draft model (``runtime/draft_runner.py``), set by start-up.
        self.draft: DraftRunner | None = None

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture pure-decode steps as CUDA graphs per batch-size bucket (``cuda_graphs``).

        Only on CUDA with the Triton attention backend (the other backends plan on the host
        per step); ValueError elsewhere.
        """
        if self.device.type != "cuda" or getattr(self.model, "attn_backend", None) is None:
            raise ValueError("decode graphs need a CUDA device")
        if self.model.attn_backend.name != "triton":
            raise ValueError("decode graphs need attention_backend 'triton'")
        if self.kv_groups:
            raise ValueError("decode graphs do not run a hybrid KV cache's per-group tables")
        arch = self.arch
        inputs = DecodeGraphInputs(
            max_rows=max_num_seqs,
            max_blocks=-(-max_model_len // self.block_size),
            block_size=self.block_size,
            num_heads=arch.num_attention_heads,
            num_kv_heads=arch.num_key_value_heads,
            max_model_len=max_model_len,
            device=self.device,
            sliding_window=self.sliding_window,
            num_sink_tokens=self.num_sink_tokens,
        )
        graphs = DecodeGraphs(inputs, graph_buckets(max_num_seqs))
        caches = self.layer_caches
        with torch.inference_mode():
            graphs.capture(lambda ids, pos, meta, ws: self.model(ids, pos, caches, meta, ws))
        self.graphs = graphs

    def prepare_inputs(self, sched: SchedulerOutput) -> InputBatch:
        """Build the flat batch tensors for ``sched`` (no cache side effects)."""
        return build_input_batch(
            sched,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            device=self.device,
            dtype=self.dtype,
            sliding_window=self.sliding_window,
            num_sink_tokens=self.num_sink_tokens,
            kv_groups=self.kv_groups,
        )

    def _timed_copy(
        self, copy: Callable[[list[tuple[int, int]]], None], pairs: list[tuple[int, int]]
    ) -> float:
        """Run one host <-> device block copy; returns its seconds (0.0 with nothing to move)."""
        if not pairs:
            return 0.0
        t0 = time.perf_counter()
        copy(pairs)
        if self.device.type == "cuda":
            # NOTE: device copies are queued asynchronously: wait for them before the clock.
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns a sampled token (and logprobs if asked) per sampling request."""
        start = time.perf_counter()
        out = ModelRunnerOutput()
        # NOTE: swap-out first: blocks it frees may be the targets of swap-in or of new tokens.
        out.swap_out_time = self._timed_copy(self.kv_cache.swap_out, sched.blocks_to_swap_out)
        out.swap_in_time = self._timed_copy(self.kv_cache.swap_in, sched.blocks_to_swap_in)
        self.kv_cache.copy_blocks(sched.blocks_to_copy)
        if self.draft is not None:  # NOTE: the draft's KV shares the target's block ids
            d = self.draft.kv_cache
            out.swap_out_time += self._timed_copy(d.swap_out, sched.blocks_to_swap_out)
            out.swap_in_time += self._timed_copy(d.swap_in, sched.blocks_to_swap_in)
            d.copy_blocks(sched.blocks_to_copy)
        if sched.scheduled and self.draft is not None:  # the draft model proposes
            sched = dataclasses.replace(sched, scheduled=self.draft.propose(sched.scheduled))
        if sched.scheduled:
            batch = self.prepare_inputs(sched)
            hidden = None
            if self.graphs is not None and is_pure_decode(batch):
                hidden = self.graphs.run(batch)  # [T, hidden] or None (no bucket)
            if hidden is None:
                hidden = self.model(
                    batch.input_ids,
                    batch.positions,
                    self.layer_caches,
                    batch.attn_meta,
                    self.workspace,
                )  # [T, hidden]
            if batch.sample_requests:
                logits = self.model.compute_logits(
                    hidden.index_select(0, batch.logits_indices), keep_dtype=True
                )  # [N, vocab], the model's dtype
                # NOTE: guarded per request: a row that fails is reported in out.failed
                # (the engine fails that request) instead of failing the whole step.
                out.sampled_token_ids, out.logprobs, out.failed = sample_guarded(
                    self.sampler, logits, batch.sample_requests, sched.grammar_bitmask
                )
                if batch.spec_requests:  # speculative decoding: accept drafts
                    fold_verified(out, batch.spec_requests)
                if batch.spec_requests and self.draft is not None:
                    self.draft.catch_up(batch.spec_requests, out.spec_num_accepted)
                    out.spec_token_ids = {
                        r.request_id: r.spec_token_ids for r in batch.spec_requests
                    }
            out.prompt_logprobs = compute_prompt_logprobs(self.model, hidden, batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        out.execute_time = time.perf_counter() - start
        return out
