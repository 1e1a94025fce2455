"""The offline API: ``LLM(...).generate(prompts, params)`` and ``.chat(messages)``."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from kvserve.engine import LLMEngine
from kvserve.engine_config import EngineConfig
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Generate text for a batch of prompts with continuous batching on a paged KV cache.

    Keyword arguments are the fields of :class:`~kvserve.engine_config.EngineConfig`
    (``model``, ``dtype``, ``device``, ``block_size``, ``num_kv_blocks``, ``kv_cache_memory``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, ``enable_prefix_caching``,
    ``preemption_mode``, ``swap_space``, ``kv_cache_dtype``, ``seed``, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        print(f"[kvserve] {self.engine.kernels.short()}", file=sys.stderr)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of ``prompts``.

        ``prompts`` is a string, a list of token ids, or a list of either. Every prompt is
        validated before any runs: a bad one raises ValueError naming it, and none runs.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(sampling_params or SamplingParams(), len(prompt_list), "params")
        prio = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(prio) != len(prompt_list):
            raise ValueError(f"priority has {len(prio)} entries for {len(prompt_list)} prompts")
        ids: list[str] = []
        try:
            for prompt, params, p in zip(prompt_list, params_list, prio, strict=True):
                ids.append(self.engine.add_request(prompt, params, priority=p))
        except ValueError as e:
            for rid in ids:
                self.engine.abort_request(rid)
            raise ValueError(f"prompt {len(ids)}: {e}") from e
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        if not messages:
            raise ValueError("messages is empty")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        finals: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm)
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        for c in out.outputs:
                            c.delta_text, c.delta_token_ids = "", []
                        finals[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in pending:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [finals[i] for i in ids]

    def stats(self) -> dict[str, Any]:
        """Capacity and latency figures (see ../shared/DESIGN.md's table)."""
        return self.engine.stats()

    def memory_report(self) -> list[str]:
        """The start-up memory budget, one line per figure."""
        return self.engine.memory_report.lines()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list")
    return list(prompts)


def _broadcast(
    value: SamplingParams | Sequence[SamplingParams], n: int, name: str
) -> list[SamplingParams]:
    if isinstance(value, SamplingParams):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"sampling {name} has {len(values)} entries for {n} prompts")
    return values
