"""What every route needs: the engine and the model's facts (``ServingContext``, kept in
``app.state.ctx``), the served-model check, and the tokenizer thread pool."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request

from kvserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from kvserve.engine.engine_like import EngineLike, TokenizerLike
from kvserve.outputs import RequestOutput
from kvserve.server import protocol as p
from kvserve.server.chat_tools import ChatPlan, prompt_messages
from kvserve.server.errors import APIError
from kvserve.server.tokenizer_pool import longest_token_bytes, run_job
from kvserve.structured.spec import StructuredOutputsParams
from kvserve.tokenizer import ChatOptionError, generation_flags

if TYPE_CHECKING:
    from kvserve.core.kv.kv_cache_manager import KVCacheManager


@dataclass
class ServingContext:
    """What the handlers need from the engine, fixed at start-up."""

    engine: AsyncLLMEngine
    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: TokenizerLike
    max_total_tokens: int  # the longest request the KV pool runs, at most max_model_len
    # The model's sampling defaults (--generation-config): SamplingParams field -> value, for
    # the fields a request leaves out (else OpenAI's defaults).
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    chat_template: str | None = None  # --chat-template: replaces the model's template
    tool_call_parser: str = "hermes"  # --tool-call-parser
    # Compiles a structured-output constraint (ValueError if invalid); runs on a tokenizer
    # thread. None: the engine has no structured output (test engines).
    validate_constraint: Callable[[StructuredOutputsParams], None] | None = None
    scheduling_policy: str = "fcfs"  # the engine's: a request's priority only under "priority"
    # The most bytes of text a prompt that fits can have (tokenizer_pool.check_fits); None:
    # no bound.
    max_prompt_bytes: int | None = None

    def __post_init__(self) -> None:
        self.token_text = functools.lru_cache(maxsize=65536)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @classmethod
    def for_engine(
        cls,
        engine: EngineLike,
        async_engine: AsyncLLMEngine,
        *,
        served_model_name: str | None = None,
        chat_template: str | None = None,
        tool_call_parser: str = "hermes",
    ) -> ServingContext:
        """The context of ``engine`` (served through ``async_engine``)."""
        max_model_len = int(engine.max_model_len)
        kv = engine.kv_cache_manager
        structured = engine.structured
        tokenizer = engine.tokenizer
        vocab_size = int(engine.arch.vocab_size)
        # NOTE: ids past the tokenizer's own (a padded embedding) spell nothing.
        num_tokens = min(vocab_size, int(tokenizer.vocab_size))
        longest = longest_token_bytes(
            lambda ids: tokenizer.decode(ids, skip_special_tokens=False), num_tokens
        )
        return cls(
            engine=async_engine,
            model_name=served_model_name
            or default_model_name(engine.model_path, engine.quantization),
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            tokenizer=tokenizer,
            max_total_tokens=longest_request(max_model_len, kv),
            sampling_defaults=dict(engine.generation_defaults.values),
            chat_template=chat_template,
            tool_call_parser=tool_call_parser,
            validate_constraint=structured.validate if structured is not None else None,
            scheduling_policy=str(engine.config.scheduling_policy),
            max_prompt_bytes=max_model_len * longest,
        )


def longest_request(max_model_len: int, kv: KVCacheManager) -> int:
    """The most tokens (prompt and output) a request can reach on ``kv``'s pool: the pool's
    tokens, or ``max_model_len`` where it is smaller or where a request that long holds few
    enough blocks at once (``max_live_blocks``: a windowed pool runs requests longer than
    itself)."""
    if kv.max_live_blocks(max_model_len) <= kv.num_blocks:
        return max_model_len
    return min(max_model_len, kv.num_blocks * kv.block_size)


def default_model_name(model_path: str, quantization: Mapping[str, Any] | None = None) -> str:
    """The model's file or directory name, without a .gguf suffix, its format tag that of the
    weights as run (``kvserve.models.quant_model.model_id``)."""
    from kvserve.models.quant_model import model_id

    return model_id(model_path, quantization)


def serving_context(request: Request) -> ServingContext:
    """The app's ServingContext (a FastAPI dependency of the routes)."""
    ctx: ServingContext = request.app.state.ctx
    return ctx


Ctx = Annotated[ServingContext, Depends(serving_context)]  # a route's ``ctx`` parameter


def served_engine(request: Request) -> EngineLike:
    """The engine the app serves (for the debug routes; the others go through ``ctx``)."""
    engine: EngineLike = request.app.state.engine
    return engine


def check_model(ctx: ServingContext, model: str | None) -> None:
    """404 unless ``model`` is the served model (None means the served model)."""
    if model is not None and model != ctx.model_name:
        raise APIError(
            f"the model {model!r} does not exist; this server serves {ctx.model_name!r}",
            status_code=404,
            param="model",
            code="model_not_found",
        )


def chat_flags(req: p.ChatCompletionRequest | p.TokenizeChatRequest) -> tuple[bool, bool]:
    """The request's (add_generation_prompt, continue_final_message), as ``generation_flags``
    resolves them (ChatOptionError if they conflict)."""
    return generation_flags(
        req.add_generation_prompt if "add_generation_prompt" in req.model_fields_set else None,
        req.continue_final_message,
        req.messages[-1].role,
    )


def render_chat(
    ctx: ServingContext,
    req: p.ChatCompletionRequest | p.TokenizeChatRequest,
    plan: ChatPlan,
) -> list[int]:
    """Runs on a tokenizer thread: the chat prompt's token ids (the server's template, else
    the model's); a template error is a 400 on ``messages``, a conflicting chat option a 400
    on that option."""
    template = ctx.chat_template or ctx.tokenizer.chat_template
    messages, extra = prompt_messages(req.messages, plan, template)
    if ctx.chat_template is not None:
        extra["chat_template"] = ctx.chat_template
    try:
        add_generation_prompt, continue_final = chat_flags(req)
        if continue_final:
            extra["continue_final_message"] = True
        if req.chat_template_kwargs:  # checked by the tokenizer (ChatOptionError)
            extra["template_kwargs"] = req.chat_template_kwargs
        return ctx.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **extra
        )
    except ChatOptionError as e:
        raise APIError(str(e), param=e.field) from e
    except ValueError as e:
        raise APIError(str(e), param="messages") from e


def usage_so_far(num_prompt: int, num_completion: int) -> p.UsageInfo:
    """One streamed choice's usage at a chunk (``continuous_usage_stats``): its prompt's
    tokens and the tokens it generated so far, as vLLM reports them."""
    return p.UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
    )


def usage(prompts: list[list[int]], finals: list[RequestOutput]) -> p.UsageInfo:
    """Token counts of a response (prompt tokens, generated tokens, cached prompt tokens)."""
    num_prompt = sum(len(ids) for ids in prompts)
    num_completion = sum(len(c.token_ids) for out in finals for c in out.outputs)
    return p.UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
        prompt_tokens_details=p.PromptTokensDetails(
            cached_tokens=sum(out.num_cached_tokens for out in finals)
        ),
    )


async def off_engine(ctx: ServingContext, fn: Callable[[], Any], size: int = 0) -> Any:
    """Run ``fn`` (tokenization, template rendering, a constraint compile) on a tokenizer
    thread, never on the engine thread: a huge prompt delays only its own request. ``size``:
    the bytes of text it reads, which pick its lane (``tokenizer_pool.run_job``).
    EngineDeadError (answered through ``errors.ENGINE_ERRORS``) if the engine has died."""
    if ctx.engine.is_dead:
        raise EngineDeadError(f"the engine loop has died: {ctx.engine.dead_error!r}")
    return await run_job(fn, size)
