"""A model-free engine with LLMEngine's interface, for tests of the async layer and the app.

Tokens are characters (id = code point); every running sample gets one token per step,
derived from the prompt, the sample index and the seed, so outputs are deterministic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from kvserve.core.outputs import Logprob
from kvserve.models.generation_config import GenerationDefaults
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams

VOCAB_SIZE = 1000


class FakeTokenizer:
    """One token per character; ids are code points below VOCAB_SIZE."""

    eos_token_id: int | None = None
    bos_token_id: int | None = None
    vocab_size = VOCAB_SIZE
    chat_template: str | None = None  # the server renders with apply_chat_template below

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [min(ord(c), VOCAB_SIZE - 1) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,  # no end-of-turn markers to leave out here
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        if not messages:
            raise ValueError("messages must be a non-empty list")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


@dataclass
class _Sample:
    token_ids: list[int] = field(default_factory=list)
    num_emitted: int = 0
    finish_reason: str | None = None


@dataclass
class _Req:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    samples: list[_Sample]


class FakeKVCacheManager:
    """Counts one block per live sample; check_integrity compares with the engine."""

    def __init__(self, engine: FakeEngine, num_blocks: int) -> None:
        self.engine = engine
        self.num_blocks = num_blocks
        self.block_size = 16

    def max_live_blocks(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` tokens holds at once (all of them)."""
        return -(-num_tokens // self.block_size)

    def check_integrity(self) -> None:
        live = sum(
            1 for r in self.engine.requests.values() for s in r.samples if s.finish_reason is None
        )
        assert live <= self.num_blocks, "more live samples than blocks"


class FakeEngine:
    """LLMEngine look-alike: add_request / step / abort_request / stats."""

    def __init__(
        self,
        *,
        max_model_len: int = 256,
        step_seconds: float = 0.002,
        num_blocks: int = 64,
        scheduling_policy: str = "fcfs",
    ) -> None:
        self.max_model_len = max_model_len
        self.config = SimpleNamespace(scheduling_policy=scheduling_policy)
        self.arch = SimpleNamespace(vocab_size=VOCAB_SIZE)
        self.tokenizer = FakeTokenizer()
        self.model_path = "/models/fake-model.gguf"
        self.generation_defaults = GenerationDefaults()  # no generation_config.json
        self.quantization: dict[str, object] | None = None  # no quantized weights
        self.step_seconds = step_seconds
        self.requests: dict[str, _Req] = {}
        self.kv_cache_manager = FakeKVCacheManager(self, num_blocks)
        self.structured = None  # no structured output: constraints are not checked
        self.fail_next_step = False
        self.fail_add_with: Exception | None = None  # add_request raises this
        self.fail_request_ids: set[str] = set()  # these end with an error output (own fault)
        self.num_aborted = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> str:
        if self.fail_add_with is not None:
            raise self.fail_add_with
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if any(not 0 <= t < VOCAB_SIZE for t in ids):
            raise ValueError("prompt token id outside the vocabulary")
        max_tokens = params.max_tokens or 1
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"prompt + max_tokens exceeds max_model_len={self.max_model_len}")
        rid = request_id or f"fake-{len(self.requests)}"
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        self.requests[rid] = _Req(
            rid, ids, params, time.monotonic(), [_Sample() for _ in range(params.n)]
        )
        self.num_prompt_tokens += len(ids)
        return rid

    def abort_request(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.num_aborted += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _next_token(self, req: _Req, index: int, sample: _Sample) -> int:
        seed = req.params.seed or 0
        k = len(sample.token_ids)
        return ord("a") + (sum(req.prompt_ids) + 7 * index + seed + k) % 26

    def step(self) -> list[RequestOutput]:
        if self.fail_next_step:
            raise RuntimeError("injected step failure")
        time.sleep(self.step_seconds)
        outputs = []
        for req in list(self.requests.values()):
            if req.request_id in self.fail_request_ids:
                failed = self._output(req)
                failed.finished, failed.error = True, "injected fault"
                outputs.append(failed)
                del self.requests[req.request_id]
                continue
            for i, s in enumerate(req.samples):
                if s.finish_reason is None:
                    s.token_ids.append(self._next_token(req, i, s))
                    self.num_generation_tokens += 1
                    if len(s.token_ids) >= (req.params.max_tokens or 1):
                        s.finish_reason = "length"
            outputs.append(self._output(req))
            if all(s.finish_reason is not None for s in req.samples):
                del self.requests[req.request_id]
        return outputs

    def _output(self, req: _Req) -> RequestOutput:
        completions = []
        for i, s in enumerate(req.samples):
            delta = s.token_ids[s.num_emitted :]
            s.num_emitted = len(s.token_ids)
            logprobs = None
            if req.params.logprobs is not None:
                logprobs = [self._logprobs(t, req.params.logprobs) for t in s.token_ids]
            completions.append(
                CompletionOutput(
                    index=i,
                    text=self.tokenizer.decode(s.token_ids),
                    token_ids=list(s.token_ids),
                    finish_reason=s.finish_reason,
                    logprobs=logprobs,
                    delta_text=self.tokenizer.decode(delta),
                    delta_token_ids=delta,
                )
            )
        finished = all(s.finish_reason is not None for s in req.samples)
        now = time.monotonic()
        return RequestOutput(
            request_id=req.request_id,
            prompt=None,
            prompt_token_ids=req.prompt_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=0,
            metrics=RequestMetrics(
                arrival_time=req.arrival,
                queue_time=0.0,
                ttft=now - req.arrival,
                e2e=(now - req.arrival) if finished else None,
            ),
        )

    @staticmethod
    def _logprobs(token_id: int, num_top: int) -> dict[int, Logprob]:
        entry = {token_id: Logprob(logprob=-0.5, rank=1)}
        for r in range(num_top - 1):
            entry[ord("A") + r] = Logprob(logprob=-2.0 - r, rank=r + 2)
        return entry

    def stats(self) -> dict[str, Any]:
        running = len(self.requests)
        return {
            "num_running": running,
            "num_waiting": 0,
            "num_swapped": 0,
            "kv_usage": running / self.kv_cache_manager.num_blocks,
            "kv_utilization": 0.5 if running else 0.0,
            "prefix_cache_queries": self.num_prompt_tokens,
            "prefix_cache_hits": 0,
            "preemptions": 0,
            "prefix_cache_evictions": 0,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
        }
