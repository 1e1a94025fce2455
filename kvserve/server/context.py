"""What every route needs: the engine and the model's facts (``ServingContext``, kept in
``app.state.ctx``), the served-model check, and the tokenizer thread pool."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request

from kvserve.async_engine import AsyncLLMEngine, EngineDeadError, EngineLike, TokenizerLike
from kvserve.outputs import RequestOutput
from kvserve.server import protocol as p
from kvserve.server.chat_tools import ChatPlan, prompt_messages
from kvserve.server.errors import APIError
from kvserve.structured.spec import StructuredOutputsParams
from kvserve.tokenizer import RESERVED_TEMPLATE_KWARGS


@dataclass
class ServingContext:
    """What the handlers need from the engine, fixed at start-up."""

    engine: AsyncLLMEngine
    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: TokenizerLike
    max_total_tokens: int  # min(max_model_len, KV pool capacity in tokens)
    chat_template: str | None = None  # --chat-template: replaces the model's template
    tool_call_parser: str = "hermes"  # --tool-call-parser
    # Compiles a structured-output constraint (ValueError if invalid); runs on a tokenizer
    # thread. None: the engine has no structured output (test engines).
    validate_constraint: Callable[[StructuredOutputsParams], None] | None = None

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
        return cls(
            engine=async_engine,
            model_name=served_model_name or default_model_name(engine.model_path),
            max_model_len=max_model_len,
            vocab_size=int(engine.arch.vocab_size),
            tokenizer=engine.tokenizer,
            max_total_tokens=min(max_model_len, kv.num_blocks * kv.block_size),
            chat_template=chat_template,
            tool_call_parser=tool_call_parser,
            validate_constraint=structured.validate if structured is not None else None,
        )


def default_model_name(model_path: str) -> str:
    """The model's file or directory name, without a .gguf suffix."""
    name = os.path.basename(str(model_path or "kvserve-model").rstrip("/"))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


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


def render_chat(
    ctx: ServingContext,
    req: p.ChatCompletionRequest | p.TokenizeChatRequest,
    plan: ChatPlan,
) -> list[int]:
    """Runs on a tokenizer thread: the chat prompt's token ids (the server's template, else
    the model's); a template error is a 400 on ``messages``."""
    add_generation_prompt, continue_final = generation_flags(req)
    template = ctx.chat_template or ctx.tokenizer.chat_template
    messages, extra = prompt_messages(req.messages, plan, template)
    if ctx.chat_template is not None:
        extra["chat_template"] = ctx.chat_template
    if continue_final:
        extra["continue_final_message"] = True
    if req.chat_template_kwargs:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & req.chat_template_kwargs.keys())
        if reserved:
            raise APIError(
                f"chat_template_kwargs: {', '.join(map(repr, reserved))} cannot be set here "
                "(the request's own fields set them)",
                param="chat_template_kwargs",
            )
        extra["template_kwargs"] = req.chat_template_kwargs
    try:
        return ctx.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **extra
        )
    except ValueError as e:
        raise APIError(str(e), param="messages") from e


def generation_flags(req: p.ChatCompletionRequest | p.TokenizeChatRequest) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) of a chat request, as vLLM takes them.

    ``continue_final_message`` (assistant prefill: the model continues the last message, which
    must be the assistant's) turns ``add_generation_prompt`` off when the request leaves it
    unset; both set true is a 400, as vLLM answers.
    """
    if not req.continue_final_message:
        return req.add_generation_prompt, False
    if req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
        raise APIError(
            "continue_final_message and add_generation_prompt cannot both be true (continue "
            "the last message, or start a new assistant turn)",
            param="continue_final_message",
        )
    last = req.messages[-1].role
    if last != "assistant":
        raise APIError(
            f"continue_final_message continues the last message, which must be the assistant's "
            f"(the text to continue); it is {last!r}",
            param="messages",
        )
    return False, True


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


# NOTE: tokenization runs here, off the engine thread: a huge prompt then delays only its
# sender (the Rust tokenizer releases the GIL while it encodes). Its calls only read the
# tokenizer, so several may run at once.
_TOKENIZER_THREADS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvserve-tokenize")


async def off_engine(ctx: ServingContext, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` (tokenization, template rendering, a constraint compile) on the tokenizer
    pool, never on the engine thread: a huge prompt delays only its own request.
    EngineDeadError (answered through ``errors.ENGINE_ERRORS``) if the engine has died."""
    if ctx.engine.is_dead:
        raise EngineDeadError(f"the engine loop has died: {ctx.engine.dead_error!r}")
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZER_THREADS, fn)
