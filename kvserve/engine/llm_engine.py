"""LLMEngine: ties the scheduler (core/) to the model runner (runtime/) and the tokenizer.

One ``step()`` = schedule -> execute -> update -> detokenize; see docs/DESIGN.md. With
``async_scheduling`` the forward runs on a thread of its own while the next step is scheduled
(``pipeline.py``, ``core/sched/ahead.py``).
Start-up is a sequence of named phases: ``engine/startup.py``. Beside this file: the checks of
what ``add_request`` is given (``inputs.py``), each request's samples and the outputs built
from them (``request_state.py``), and failing requests for faults of their own
(``failures.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any

from kvserve.core.kv.kv_groups import group_size
from kvserve.core.kv.metrics import HostTransferStats
from kvserve.core.outputs import LogprobsEntry, ModelRunnerOutput
from kvserve.core.sched.ahead import can_schedule_ahead, resolve_ahead
from kvserve.core.sched.step_cost import step_record
from kvserve.core.sched.stop_checks import is_stop_token
from kvserve.detokenizer import IncrementalDetokenizer
from kvserve.distributed.spawn_check import refuse_tp_engine_while_importing_main
from kvserve.engine.config import EngineConfig
from kvserve.engine.draft_model import (
    attach_draft,
    draft_activation_bytes,
    draft_kv_bytes_per_token,
    load_draft,
    resolve_draft_source,
    with_draft_cost,
    with_draft_weights,
)
from kvserve.engine.failures import RequestFailures, fail_group
from kvserve.engine.inputs import check_constraints, tokenize_prompt
from kvserve.engine.memory_budget import MemoryReport, measure_growth, plan_step_activations
from kvserve.engine.metrics import LatencyStats
from kvserve.engine.pipeline import ForwardThread, PlannedStep, has_work
from kvserve.engine.request_state import RequestGroup, SampleState, make_output
from kvserve.engine.startup import (
    build_kv_cache_manager,
    build_runner,
    build_scheduler,
    choose_kernels,
    kv_groups_of,
    load_engine_model,
    measure_gemm_scratch,
    resolve_max_model_len,
    resolve_model_source,
    size_kv_pool,
    startup_line,
)
from kvserve.engine.step_guard import execute_isolated
from kvserve.models.generation_config import load_generation_defaults
from kvserve.outputs import RequestOutput
from kvserve.request import Request, RequestStatus
from kvserve.runtime.kv_cache import kv_bytes_per_token
from kvserve.runtime.native.chunk_limit import ChunkAttention
from kvserve.sampling_params import SamplingParams
from kvserve.structured.manager import StructuredOutputManager

logger = logging.getLogger("kvserve")


class LLMEngine:
    """Synchronous engine: ``add_request``, ``step``, ``abort_request``."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        config = config.replace(**kwargs) if config else EngineConfig(**kwargs)
        # NOTE: a spawned TP worker re-importing a script that builds the engine at top level
        # exits here, before any weight is read; the driver then names the fix.
        refuse_tp_engine_while_importing_main(config.tensor_parallel_size)
        self.config = config
        self._inflight: PlannedStep | None = None  # async scheduling: the step running now
        self._carried_finished: set[str] = set()  # finished ids of a step ahead left empty
        # NOTE: async scheduling runs all torch work, start-up included, on one thread.
        self.forward_thread = ForwardThread() if config.async_scheduling else None
        if self.forward_thread is None:
            self._start_up(config)
            return
        try:
            self.forward_thread.call(lambda: self._start_up(config))
        except BaseException:
            self.forward_thread.close()
            raise

    def _start_up(self, config: EngineConfig) -> None:
        """The start-up phases (``engine/startup.py``), in order."""
        t0 = time.perf_counter()
        # Start-up phases (kvserve/engine/startup.py), in order; each takes what the earlier
        # ones produced.
        self.config = config = resolve_draft_source(resolve_model_source(config))
        self.kernels = choose_kernels(config)
        self.config = config = config.replace(dtype=self.kernels.dtype_name)
        loaded = load_engine_model(config, self.kernels)
        self.kernels = loaded.kernels  # NOTE: quantized projections may revise an auto dtype
        self.config = config = config.replace(dtype=self.kernels.dtype_name)
        self.model_path, self.arch, self.tokenizer = loaded.path, loaded.arch, loaded.tokenizer
        # The model's sampling defaults (--generation-config), for requests that leave a
        # field out: the server, LLM.get_default_sampling_params and the CLI apply them.
        self.generation_defaults = load_generation_defaults(config.generation_config, loaded.path)
        self.packed_weights_bytes = loaded.packed_weights_bytes
        self.quantization = loaded.quantization
        self.tp = loaded.tp  # the tensor-parallel executor (kvserve/distributed) or None
        arch = loaded.arch
        self.max_model_len = resolve_max_model_len(config, arch)
        draft = load_draft(config, loaded, self.max_model_len)  # speculative decoding's, or None
        kv_groups = kv_groups_of(config, arch)  # a hybrid KV cache's groups, else None
        # NOTE: exact, the per-token-per-head scales of int8/fp8 caches included; per block
        # id (one group's layers) with a hybrid KV cache.
        self.kv_bytes_per_token = kv_bytes_per_token(
            num_layers=group_size(kv_groups) if kv_groups else arch.num_hidden_layers,
            num_kv_heads=loaded.runner_arch.num_key_value_heads,
            head_dim=arch.head_dim,
            kv_cache_dtype=config.kv_cache_dtype,
            dtype=loaded.dtype,
        ) + draft_kv_bytes_per_token(config, draft)  # NOTE: a block holds the draft's KV too
        chunk_attention = ChunkAttention.of(getattr(loaded.model, "attn_backend", None))
        activation_plan, tracing_bytes = measure_growth(
            config.device,
            lambda: plan_step_activations(
                config, arch, max_model_len=self.max_model_len, chunk_attention=chunk_attention
            ),
        )
        kernel_scratch = measure_gemm_scratch(config, activation_plan, loaded.model)
        self.memory_report: MemoryReport = size_kv_pool(
            config,
            with_draft_weights(loaded, draft),
            kv_bytes_per_token=self.kv_bytes_per_token,
            max_model_len=self.max_model_len,
            activation_plan=activation_plan,
            kernel_scratch_bytes=kernel_scratch,
            tracing_bytes=tracing_bytes,
            kv_groups=kv_groups,
            extra_activation_bytes=draft_activation_bytes(config, draft, self.max_model_len),
        )
        # NOTE: under tensor parallelism the report becomes the per-rank one.
        self.runner, self.memory_report = build_runner(
            config, loaded, self.memory_report, self.max_model_len
        )
        rep = self.memory_report
        attach_draft(self.runner, draft, config, rep)
        self.config = config = with_draft_cost(config, loaded, draft)
        del loaded, draft  # NOTE: the runner holds the model; nothing else of the load stays alive
        self.kv_cache_manager = build_kv_cache_manager(config, rep, self.max_model_len)
        self.scheduler = build_scheduler(config, self.max_model_len, self.kv_cache_manager)
        self.latency = LatencyStats()
        self.host_transfers = HostTransferStats()
        self._groups: dict[str, RequestGroup] = {}
        self._sample_to_group: dict[str, RequestGroup] = {}
        self._ids = itertools.count()
        self.structured = StructuredOutputManager(
            self.tokenizer.hf_tokenizer,
            arch.vocab_size,
            self.tokenizer.eos_token_id,
            compact_json=config.disable_any_whitespace,
        )
        self.startup_seconds = time.perf_counter() - t0
        self.num_steps = 0
        self.failures = RequestFailures(
            self.scheduler, self.kv_cache_manager, self._sample_to_group.get
        )
        self.step_records: list[dict[str, float]] = []
        for line in rep.lines():
            logger.debug(line)
        logger.info(startup_line(self))
        if self.generation_defaults.values:
            logger.info(self.generation_defaults.describe())

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
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        # NOTE: checked before anything is queued: the waiting queue orders by priority, and
        # one value that does not compare with ints would break every later insert.
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        max_num_seqs = self.scheduler.config.max_num_seqs
        if params.n > max_num_seqs:
            raise ValueError(
                f"SamplingParams.n={params.n} exceeds max_num_seqs={max_num_seqs} (the samples "
                "of one request run at once)"
            )
        # NOTE: every sample's id, finished or not, stays the engine's until its request
        # ends: "a#1" names sample 1 of a live "a" (and "a" with n > 1 needs "a#1" free).
        for rid in [request_id] + [f"{request_id}#{i}" for i in range(1, params.n)]:
            if rid in self._sample_to_group:
                raise ValueError(f"request_id {rid!r} is already in use")
        prompt_text, token_ids = tokenize_prompt(self.tokenizer, self.arch.vocab_size, prompt)
        # NOTE: the model's other end-of-turn ids (generation_config.json) stop it as EOS does,
        # as stop_token_ids (vLLM's update_from_generation_config).
        end_ids = self.generation_defaults.end_token_ids(self.tokenizer.eos_token_id)
        if end_ids and not params.ignore_eos:
            stops = list(dict.fromkeys([*(params.stop_token_ids or []), *end_ids]))
            params = dataclasses.replace(params, stop_token_ids=stops)
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
        check_constraints(params, self.arch.vocab_size, self.structured)
        self.scheduler.add_request(samples[0])  # raises ValueError if it can never fit
        if params.structured_outputs is not None:
            # NOTE: compiled in check_constraints, so this is a cache hit and cannot fail.
            self.structured.add_request([r.request_id for r in samples], params.structured_outputs)
        group = RequestGroup(request_id, prompt_text, token_ids, params)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        for req in samples:
            group.samples.append(
                SampleState(
                    request=req,
                    detok=IncrementalDetokenizer(self.tokenizer, params, token_ids),
                    logprobs=[] if params.logprobs is not None else None,
                )
            )
            self._sample_to_group[req.request_id] = group
        self._groups[request_id] = group
        self.latency.num_prompt_tokens += len(token_ids)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Abort a request (all its samples) in any state; frees everything it holds."""
        group = self._groups.get(request_id)
        if group is None:
            return
        ids = [s.request.request_id for s in group.samples if not s.request.is_finished]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        self._finish_group(group)
        self._settle_if_idle()

    def has_unfinished_requests(self) -> bool:
        """True while a request is unfinished (or, async scheduling, a step is running)."""
        return self.scheduler.has_unfinished_requests() or self._inflight is not None

    @property
    def num_failed_requests(self) -> int:
        """Requests failed by a fault of their own."""
        return self.failures.num_failed_requests

    @property
    def num_request_states(self) -> int:
        """Per-request entries the engine holds (groups, samples, grammar matchers): 0 once
        every request has finished, failed or been aborted (nothing is kept per request)."""
        return len(self._groups) + len(self._sample_to_group) + self.structured.num_matchers

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; returns outputs of requests that changed."""
        if self.forward_thread is not None:
            return self._step_async()
        t0 = time.perf_counter()
        planned = self._plan()
        planned.grammar_faults = self.structured.prepare(planned.sched, self.scheduler.get_request)
        # NOTE: requests whose own work fails (a raise isolated by bisection, non-finite
        # logits, a bad draw) come back in runner_out.failed; a fault no request can be
        # blamed for raises StepFault and stops the engine.
        runner_out = execute_isolated(self.runner.execute, planned.sched)
        return self._apply_step(planned, runner_out, t0)

    def _plan(self) -> PlannedStep:
        sched = self.scheduler.schedule()
        return PlannedStep(sched, self.scheduler.last_step.schedule_time_s)

    def _step_async(self) -> list[RequestOutput]:
        """One step under async scheduling (``pipeline.py``): schedule the next step while
        this one's forward runs, apply this one, launch the next, then detokenize."""
        t0 = time.perf_counter()
        if self._inflight is None:
            self._launch(self._plan())
        current = self._inflight
        if current is None or current.future is None:
            raise RuntimeError("async scheduling: no step was launched")
        ahead = None
        requests = self.scheduler.requests
        if requests and can_schedule_ahead(requests, current.sched):
            # NOTE: pure Python while the forward thread runs torch (which drops the GIL).
            ahead = self._plan()
        runner_out = current.future.result()
        self._inflight = None
        outputs = self._apply_step(current, runner_out, t0, ahead)
        self._settle_if_idle()
        return outputs

    def _launch(self, planned: PlannedStep) -> None:
        """Prepare ``planned``'s grammar bitmask and start its forward on the forward thread."""
        if self.forward_thread is None:
            raise RuntimeError("_launch needs async_scheduling")
        sched = planned.sched
        sched.finished_req_ids |= self._carried_finished
        self._carried_finished = set()
        planned.grammar_faults = self.structured.prepare(sched, self.scheduler.get_request)
        execute = self.runner.execute
        planned.future = self.forward_thread.submit(lambda: execute_isolated(execute, sched))
        self._inflight = planned

    def _launch_ahead(self, ahead: PlannedStep) -> None:
        """Once the step before it is applied: drop finished requests' work from the step
        scheduled ahead, fill its placeholders in and launch it (if anything is left)."""
        resolve_ahead(self.scheduler.requests, ahead.sched)
        if has_work(ahead.sched):
            self._launch(ahead)
        else:
            self._carried_finished |= ahead.sched.finished_req_ids

    def _settle_if_idle(self) -> None:
        """Async scheduling: with no request left, let the step in flight end now (its
        requests have all finished; nothing it returns is used) so the engine is idle."""
        current = self._inflight
        if current is None or current.future is None or self.scheduler.has_unfinished_requests():
            return
        self._inflight = None
        self._apply_step(current, current.future.result(), time.perf_counter())

    def _apply_step(
        self,
        planned: PlannedStep,
        runner_out: ModelRunnerOutput,
        t0: float,
        ahead: PlannedStep | None = None,
    ) -> list[RequestOutput]:
        """Apply an executed step: failures, tokens, stop checks, then (async scheduling)
        launch the step scheduled ``ahead``, then detokenize and build the outputs."""
        sched = planned.sched
        ahead_sched = ahead.sched if ahead is not None else None
        failed = self.failures.fail_faulted(sched, runner_out.failed, ahead_sched)
        # NOTE: a request the grammar engine failed still ran in the forward (its KV is
        # written, so readers of its blocks are unaffected); its sampled token is ignored.
        failed.update(self.failures.fail_grammar_faults(planned.grammar_faults))
        self.host_transfers.record(sched, runner_out, self.kv_cache_manager.counters)
        changed = self.scheduler.update_from_output(sched, runner_out)
        failed.update(self._after_step_extras(runner_out, changed))
        if ahead is not None:
            self._launch_ahead(ahead)
        now = time.monotonic()
        touched: dict[str, RequestGroup] = {}
        for req in changed:
            group = self._sample_to_group.get(req.request_id)
            if group is None:
                continue
            state = group.samples[req.sample_index]
            try:
                self._consume_tokens(state, runner_out.logprobs.get(req.request_id), now)
            except Exception as e:  # noqa: BLE001 - this request's detokenization only
                logger.exception("detokenizing %s failed", req.request_id)
                fail_group(self.scheduler, group, f"detokenization failed: {e!r}")
                failed[group.request_id] = group
                continue
            touched[group.request_id] = group
        for rid in failed:
            touched.pop(rid, None)
        outputs = [make_output(g, delta=True) for g in touched.values()]
        outputs += [make_output(g, delta=True) for g in failed.values()]
        for group in failed.values():
            self._finish_group(group)
        for group in touched.values():
            if all(s.request.is_finished for s in group.samples):
                self._finish_group(group)
        self.num_steps += 1
        self.step_records.append(
            {
                **step_record(sched, time.perf_counter() - t0),
                # NOTE: seconds - schedule_seconds - execute_seconds is the engine's own
                # per-step cost (token bookkeeping, stop checks, detokenization, outputs).
                "schedule_seconds": planned.schedule_seconds,
                "execute_seconds": runner_out.execute_time,
            }
        )
        self.scheduler.observe_step(self.step_records[-1])
        if len(self.step_records) > 100_000:
            del self.step_records[:50_000]
        return outputs

    def _after_step_extras(
        self, runner_out: Any, changed: list[Request]
    ) -> dict[str, RequestGroup]:
        """Structured output and prompt logprobs: matchers consume the new tokens (an
        unfinished request whose grammar has ended stops); prompt logprobs are recorded.
        Returns the requests failed because the grammar engine raised for them."""
        ended, grammar_faults = self.structured.update(changed)
        if ended:
            self.scheduler.finish_requests(ended, RequestStatus.FINISHED_STOPPED)
        for rid, (first_pos, entries) in runner_out.prompt_logprobs.items():
            group = self._sample_to_group.get(rid)
            if group is None or group.prompt_logprobs is None or rid != group.request_id:
                continue
            for pos, entry in enumerate(entries, start=first_pos):
                # NOTE: a recompute preemption scores the prompt again; keep the first.
                if pos == len(group.prompt_logprobs):
                    group.prompt_logprobs.append(entry)
        return self.failures.fail_grammar_faults(grammar_faults)

    def _consume_tokens(
        self, state: SampleState, logprobs: LogprobsEntry | None, now: float
    ) -> None:
        req = state.request
        new_ids = req.output_token_ids[len(state.detok.token_ids) :]
        if new_ids:
            gap = None if state.last_token_time is None else now - state.last_token_time
            state.last_token_time = now
            self.latency.record_token(gap, len(new_ids))
            # NOTE: a request stopped by a grammar or a stop string did not end on its token.
            stop_token = req.status == RequestStatus.FINISHED_STOPPED and is_stop_token(
                req, new_ids[-1]
            )
            state.detok.add_tokens(new_ids, stop_token=stop_token)
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

    def _finish_group(self, group: RequestGroup) -> None:
        self._groups.pop(group.request_id, None)
        for s in group.samples:
            self._sample_to_group.pop(s.request.request_id, None)
            self.structured.free(s.request.request_id)

    # ---- figures --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Capacity and latency figures by the names of DESIGN.md's table."""
        out: dict[str, Any] = dict(self.scheduler.stats())
        out["kv_bytes_per_token"] = self.kv_bytes_per_token
        out["num_steps"] = self.num_steps
        out["num_failed_requests"] = self.num_failed_requests
        out["num_prompt_tokens"] = self.latency.num_prompt_tokens
        out["num_generation_tokens"] = self.latency.num_generation_tokens
        out.update(self.latency.as_dict())
        out.update(self.host_transfers.as_dict(self.config.block_size))
        out["quantization"] = self.quantization
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
