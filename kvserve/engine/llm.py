"""The offline API: ``LLM(...).generate(prompts, params)`` and ``.chat(messages)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from kvserve.engine.config import EngineConfig
from kvserve.engine.inputs import is_token_id
from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import Tokenizer, generation_flags

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Generate text for a batch of prompts with continuous batching on a paged KV cache.

    Keyword arguments are the fields of :class:`~kvserve.engine.config.EngineConfig`
    (``model``, ``dtype``, ``device``, ``block_size``, ``num_kv_blocks``, ``kv_cache_memory``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, ``enable_prefix_caching``,
    ``preemption_mode``, ``swap_space``, ``kv_cache_dtype``, ``seed``, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

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
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _broadcast(sampling_params, len(prompt_list), "params")
        prio = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(prio) != len(prompt_list):
            raise ValueError(f"priority has {len(prio)} entries for {len(prompt_list)} prompts")
        ids: list[str] = []
        try:
            for prompt, params, p in zip(prompt_list, params_list, prio, strict=True):
                ids.append(self.engine.add_request(prompt, params, priority=p))
        except Exception as e:
            # NOTE: any failure, not only ValueError: what was queued must not run later.
            for rid in ids:
                self.engine.abort_request(rid)
            if isinstance(e, ValueError):
                raise ValueError(f"prompt {len(ids)}: {e}") from e
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate.

        As vLLM's: ``chat_template`` replaces the model's; ``continue_final_message`` leaves
        the last message (the assistant's) open for the model to continue, and then
        ``add_generation_prompt`` (default: on otherwise) is off unless set; both true is a
        ValueError. ``chat_template_kwargs`` are more template variables. A message's
        ``content`` may be a list of ``{"type": "text", "text": ...}`` parts. Each output's
        ``prompt`` is the rendered prompt text.
        """
        if not messages:
            raise ValueError("messages is empty")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        texts = []
        for conv in conversations:
            plain = [_plain_message(m, i) for i, m in enumerate(conv)]  # type: ignore[union-attr]
            last_role = plain[-1].get("role") if plain and isinstance(plain[-1], dict) else None
            add_prompt, continue_final = generation_flags(
                add_generation_prompt, continue_final_message, last_role
            )
            texts.append(
                self.tokenizer.render_chat_template(
                    plain,
                    add_prompt,
                    chat_template=chat_template,
                    continue_final_message=continue_final,
                    template_kwargs=chat_template_kwargs,
                )
            )
        # NOTE: add_special_tokens=False: the template writes BOS and markers itself.
        prompts = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)  # type: ignore[arg-type]
        for out, text in zip(outputs, texts, strict=True):
            out.prompt = text
        return outputs

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's sampling defaults (``--generation-config``:
        its generation_config.json by default), what ``generate`` and ``chat`` use when given
        none (vLLM's ``LLM.get_default_sampling_params``)."""
        return SamplingParams(**self.engine.generation_defaults.values)

    def get_tokenizer(self) -> Tokenizer:
        """The engine's tokenizer (vLLM's ``LLM.get_tokenizer``)."""
        return self.tokenizer

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
        """Capacity and latency figures (see docs/DESIGN.md's table)."""
        return self.engine.stats()

    def memory_report(self) -> list[str]:
        """The start-up memory budget, one line per figure."""
        return self.engine.memory_report.lines()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if hasattr(prompts, "tolist"):  # a numpy array or a tensor of token ids (1-D or 2-D)
        prompts = prompts.tolist()
    if isinstance(prompts, (list, tuple)) and prompts and all(map(is_token_id, prompts)):
        return [list(prompts)]  # type: ignore[arg-type]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list")
    return list(prompts)


def _plain_message(message: Any, index: int) -> Any:
    """``message`` with its content as one string: a list of text parts joined (a part of any
    other type is a ValueError naming it); anything else is left to the template's checks."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    texts = []
    for part in message["content"]:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(
                f"messages[{index}].content: only text parts are supported, got {kind!r}"
            )
        texts.append(part["text"])
    return {**message, "content": "".join(texts)}


def _broadcast(
    value: SamplingParams | Sequence[SamplingParams], n: int, name: str
) -> list[SamplingParams]:
    if isinstance(value, SamplingParams):
        return [value] * n
    if not isinstance(value, Sequence):
        raise TypeError(
            f"sampling_params must be a SamplingParams or a list of them, got {value!r}"
        )
    values = list(value)
    if len(values) != n:
        raise ValueError(f"sampling {name} has {len(values)} entries for {n} prompts")
    for i, v in enumerate(values):
        if not isinstance(v, SamplingParams):
            raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {v!r}")
    return values
