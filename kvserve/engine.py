"""LLMEngine: ties the scheduler (core/) to the model runner (runtime/) and the tokenizer.

One ``step()`` = schedule -> execute -> update -> detokenize; see ../shared/DESIGN.md.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.core.contiguous import ContiguousKVCacheManager
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.metrics import HostTransferStats
from kvserve.core.outputs import LogprobsEntry
from kvserve.core.scheduler import Scheduler
from kvserve.core.window import KVWindow, WindowedKVCacheManager
from kvserve.engine_config import EngineConfig
from kvserve.engine_metrics import LatencyStats
from kvserve.kernel_setup import choose_dtype_and_kernels
from kvserve.memory_budget import (
    MemoryReport,
    measure_kernel_scratch,
    plan_kv_blocks,
    plan_step_activations,
)
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import load_arch, load_model
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.request import Request, RequestStatus
from kvserve.runtime.kernel_select import plan_of
from kvserve.runtime.kv_cache import kv_bytes_per_token
from kvserve.runtime.model_runner import ModelRunner
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("kvserve")


@dataclass
class _SampleState:
    """Engine-side state of one sample: its detokenizer and logprobs."""

    request: Request
    detok: IncrementalDetokenizer
    logprobs: list[LogprobsEntry] | None
    cumulative_logprob: float = 0.0
    num_emitted_tokens: int = 0  # tokens already reported as deltas
    num_emitted_chars: int = 0  # characters of text already reported as deltas
    last_token_time: float | None = None


@dataclass
class _Group:
    """All samples of one user request (n of them) plus what the caller gave us."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_SampleState] = field(default_factory=list)
    reported_finished: bool = False


class LLMEngine:
    """Synchronous engine: ``add_request``, ``step``, ``abort_request``."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        config = config.replace(**kwargs) if config else EngineConfig(**kwargs)
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        t0 = time.perf_counter()
        # The dtype (for "auto") and the projection kernels, measured on the model's shapes
        # (or read from the cache) before any weight is read.
        self.kernels = choose_dtype_and_kernels(config, load_arch(config.model))
        dtype = self.kernels.dtype
        self.config = config = config.replace(dtype=self.kernels.dtype_name)
        loaded = load_model(config.model, dtype=dtype)
        self.model_path = loaded.path
        self.arch = arch = loaded.arch
        self.tokenizer = Tokenizer.from_loaded(loaded.tokenizer_dir, loaded.gguf_file)
        self.tp = None  # the tensor-parallel executor (kvserve/distributed) when size > 1
        model_arch = arch  # this process's shapes: rank 0's heads under tensor parallelism
        if config.tensor_parallel_size > 1:
            from kvserve.distributed.executor import TensorParallelExecutor

            self.tp = TensorParallelExecutor.start(config, arch)
            model = self.tp.build_model(loaded.state_dict)
            model_arch = self.tp.runner_arch()
        else:
            model = LlamaForCausalLM(arch)
            model.load_weights(loaded.state_dict)
            model = model.to(device=config.device, dtype=dtype).eval()
        del loaded
        model.set_linear_plan(plan_of(self.kernels.selection))
        # NOTE: prepacked weight copies are held beside the parameters: counted as weights.
        self.packed_weights_bytes = sum(lin.extra_nbytes for lin in model.linears())
        logger.info(
            "%s; prepacked weight copies %.1f MiB (counted as weights)",
            self.kernels.summary(),
            self.packed_weights_bytes / (1 << 20),
        )
        weights_bytes = (
            sum(p.numel() * p.element_size() for p in model.parameters())
            + sum(b.numel() * b.element_size() for b in model.buffers())
            + self.packed_weights_bytes
        )
        self.max_model_len = min(
            config.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings
        )
        if config.max_model_len is not None and config.max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's context length "
                f"{arch.max_position_embeddings}"
            )
        # NOTE: exact, the per-token-per-head scales of int8/fp8 caches included.
        self.kv_bytes_per_token = kv_bytes_per_token(
            num_layers=arch.num_hidden_layers,
            num_kv_heads=model_arch.num_key_value_heads,
            head_dim=arch.head_dim,
            kv_cache_dtype=config.kv_cache_dtype,
            dtype=dtype,
        )
        activation_plan = plan_step_activations(config, arch, max_model_len=self.max_model_len)
        # NOTE: before the KV pool exists; the weights serve as the GEMMs' right operands.
        kernel_scratch = measure_kernel_scratch(
            config, activation_plan, [p.t() for p in model.parameters() if p.dim() == 2]
        )
        self.memory_report: MemoryReport = plan_kv_blocks(
            config,
            arch,
            weights_bytes=weights_bytes,
            kv_bytes_per_token=self.kv_bytes_per_token,
            max_model_len=self.max_model_len,
            activation_plan=activation_plan,
            device_free_bytes=_device_free_bytes(config.device),
            kernel_scratch_bytes=kernel_scratch,
            packed_weights_bytes=self.packed_weights_bytes,
        )
        rep = self.memory_report
        runner_kwargs = dict(
            num_blocks=rep.num_kv_blocks,
            block_size=config.block_size,
            num_host_blocks=rep.num_host_blocks,
            device=config.device,
            dtype=dtype,
            seed=config.seed,
            kv_cache_dtype=config.kv_cache_dtype,
            kv_window=config.kv_window,
            kv_sink_tokens=config.kv_sink_tokens,
        )
        self.runner = ModelRunner(model, model_arch, **runner_kwargs)
        if self.tp is not None:
            from kvserve.distributed.executor import TPRunner

            self.tp.start_runners(self.runner, runner_kwargs)
            self.runner = TPRunner(self.tp)  # type: ignore[assignment]
            self.memory_report = rep = self.tp.memory_report(rep)
        self.kv_cache_manager: KVCacheManager
        if config.kv_window is not None:
            if config.enable_prefix_caching or config.enable_host_prefix_cache:
                logger.info("kv_window set: prefix caching is off for windowed eviction")
            self.kv_cache_manager = WindowedKVCacheManager(
                rep.num_kv_blocks,
                config.block_size,
                kv_window=KVWindow(config.kv_window, config.kv_sink_tokens),
                num_host_blocks=rep.num_host_blocks,
            )
        elif config.kv_allocator == "contiguous":
            if config.enable_prefix_caching:
                logger.info("kv_allocator=contiguous: prefix caching is off (no block sharing)")
            self.kv_cache_manager = ContiguousKVCacheManager(
                rep.num_kv_blocks,
                config.block_size,
                max_model_len=self.max_model_len,
                num_host_blocks=rep.num_host_blocks,
            )
        else:
            self.kv_cache_manager = KVCacheManager(
                rep.num_kv_blocks,
                config.block_size,
                enable_prefix_caching=config.enable_prefix_caching,
                num_host_blocks=rep.num_host_blocks,
                enable_host_prefix_cache=config.enable_host_prefix_cache,
            )
        self.scheduler = Scheduler(
            config.scheduler_config(self.max_model_len), self.kv_cache_manager
        )
        self.latency = LatencyStats()
        self.host_transfers = HostTransferStats()
        self._groups: dict[str, _Group] = {}
        self._sample_to_group: dict[str, _Group] = {}
        self._ids = itertools.count()
        self.startup_seconds = time.perf_counter() - t0
        self.num_steps = 0
        self.step_records: list[dict[str, float]] = []
        for line in rep.lines():
            logger.info(line)

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises ValueError if it is invalid or can never fit.

        On error nothing is queued (the engine's state is unchanged).
        """
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_text, token_ids = self._tokenize(prompt)
        now = time.monotonic() if arrival_time is None else arrival_time
        samples = [
            Request(
                request_id=request_id if i == 0 else f"{request_id}#{i}",
                prompt_token_ids=token_ids,
                sampling_params=params,
                eos_token_id=self.tokenizer.eos_token_id,
                arrival_time=now,
                priority=priority,
                cache_salt=cache_salt,
                parent_id=None if i == 0 else request_id,
                sample_index=i,
            )
            for i in range(params.n)
        ]
        samples[0].pending_children = samples[1:]
        self.scheduler.add_request(samples[0])  # raises ValueError if it can never fit
        group = _Group(request_id, prompt_text, token_ids, params)
        for req in samples:
            group.samples.append(
                _SampleState(
                    request=req,
                    detok=IncrementalDetokenizer(self.tokenizer, params, token_ids),
                    logprobs=[] if params.logprobs is not None else None,
                )
            )
            self._sample_to_group[req.request_id] = group
        self._groups[request_id] = group
        self.latency.num_prompt_tokens += len(token_ids)
        return request_id

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        vocab = self.arch.vocab_size
        for t in prompt:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        return None, list(prompt)

    def abort_request(self, request_id: str) -> None:
        """Abort a request (all its samples) in any state; frees everything it holds."""
        group = self._groups.get(request_id)
        if group is None:
            return
        ids = [s.request.request_id for s in group.samples if not s.request.is_finished]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        self._finish_group(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; returns outputs of requests that changed."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        runner_out = self.runner.execute(sched)
        self.host_transfers.record(sched, runner_out, self.kv_cache_manager.counters)
        changed = self.scheduler.update_from_output(sched, runner_out)
        now = time.monotonic()
        touched: dict[str, _Group] = {}
        for req in changed:
            group = self._sample_to_group.get(req.request_id)
            if group is None:
                continue
            state = group.samples[req.sample_index]
            self._consume_tokens(state, runner_out.logprobs.get(req.request_id), now)
            touched[group.request_id] = group
        outputs = [self._make_output(g, delta=True) for g in touched.values()]
        for group in touched.values():
            if all(s.request.is_finished for s in group.samples):
                self._finish_group(group)
        self.num_steps += 1
        num_prefill = sum(len(r.token_ids) for r in sched.scheduled if len(r.token_ids) > 1)
        self.step_records.append(
            {
                "num_prefill_tokens": num_prefill,
                "num_decode_tokens": sched.total_num_scheduled_tokens - num_prefill,
                "num_context_tokens": sum(r.start_pos + len(r.token_ids) for r in sched.scheduled),
                "num_seqs": len(sched.scheduled),
                "seconds": time.perf_counter() - t0,
                # NOTE: seconds - schedule_seconds - execute_seconds is the engine's own
                # per-step cost (token bookkeeping, stop checks, detokenization, outputs).
                "schedule_seconds": self.scheduler.last_step.schedule_time_s,
                "execute_seconds": runner_out.execute_time,
            }
        )
        if len(self.step_records) > 100_000:
            del self.step_records[:50_000]
        return outputs

    def _consume_tokens(
        self, state: _SampleState, logprobs: LogprobsEntry | None, now: float
    ) -> None:
        req = state.request
        new_ids = req.output_token_ids[len(state.detok.token_ids) :]
        if new_ids:
            gap = None if state.last_token_time is None else now - state.last_token_time
            state.last_token_time = now
            self.latency.record_token(gap)
            state.detok.add_tokens(new_ids)
            if state.logprobs is not None and logprobs is not None:
                state.logprobs.append(logprobs)
                chosen = logprobs.get(new_ids[-1])
                if chosen is not None:
                    state.cumulative_logprob += chosen.logprob
            if state.detok.stop_matched is not None and not req.is_finished:
                req.stop_reason = state.detok.stop_matched
                self.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_STOPPED)
        if req.is_finished:
            # NOTE: streaming holds back text that could start a stop string (or half a
            # character); once the request is over, release it.
            if state.detok.stop_matched is None:
                state.detok.flush()
            self.latency.record_finished(req)

    def _finish_group(self, group: _Group) -> None:
        self._groups.pop(group.request_id, None)
        for s in group.samples:
            self._sample_to_group.pop(s.request.request_id, None)

    def _make_output(self, group: _Group, *, delta: bool) -> RequestOutput:
        completions = []
        for s in group.samples:
            req = s.request
            text = s.detok.text
            delta_ids = req.output_token_ids[s.num_emitted_tokens :] if delta else []
            delta_text = text[s.num_emitted_chars :] if delta else ""
            if delta:
                s.num_emitted_tokens = req.num_output_tokens
                s.num_emitted_chars = len(text)
            completions.append(
                CompletionOutput(
                    index=req.sample_index,
                    text=text,
                    token_ids=list(req.output_token_ids),
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                    logprobs=list(s.logprobs) if s.logprobs is not None else None,
                    cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                    delta_text=delta_text,
                    delta_token_ids=delta_ids,
                )
            )
        head = group.samples[0].request
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=all(s.request.is_finished for s in group.samples),
            num_cached_tokens=max(head.num_cached_tokens, 0),
            metrics=_metrics(head),
        )

    # ---- figures --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Capacity and latency figures by the names of DESIGN.md's table."""
        out: dict[str, Any] = dict(self.scheduler.stats())
        out["kv_bytes_per_token"] = self.kv_bytes_per_token
        out["num_steps"] = self.num_steps
        out["num_prompt_tokens"] = self.latency.num_prompt_tokens
        out["num_generation_tokens"] = self.latency.num_generation_tokens
        out.update(self.latency.as_dict())
        out.update(self.host_transfers.as_dict(self.config.block_size))
        out["memory"] = {
            "weights_bytes": self.memory_report.weights_bytes,
            "activation_bytes": self.memory_report.activation_bytes,
            "planned_activation_bytes": (
                self.memory_report.activation_plan.planned_peak_bytes
                if self.memory_report.activation_plan is not None
                else None
            ),
            "kernel_scratch_bytes": self.memory_report.kernel_scratch_bytes,
            "kv_cache_bytes": self.memory_report.kv_cache_bytes,
            "num_host_blocks": self.memory_report.num_host_blocks,
        }
        return out


def _metrics(req: Request) -> RequestMetrics:
    m = RequestMetrics(arrival_time=req.arrival_time)
    if req.first_scheduled_time is not None:
        m.queue_time = req.first_scheduled_time - req.arrival_time
    if req.first_token_time is not None:
        m.ttft = req.first_token_time - req.arrival_time
        if req.last_token_time is not None and req.num_output_tokens > 1:
            m.tpot = (req.last_token_time - req.first_token_time) / (req.num_output_tokens - 1)
    if req.finished_time is not None:
        m.e2e = req.finished_time - req.arrival_time
    return m


def _device_free_bytes(device: str) -> int | None:
    if device.startswith("cuda") and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return free
    return None
