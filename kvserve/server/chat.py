"""POST /v1/chat/completions: messages (and tools) -> one engine request -> JSON or SSE."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvserve.engine.async_engine import RequestStream
from kvserve.server import protocol as p
from kvserve.server.chat_tools import ChatPlan, ToolStream, drop_none, plan_chat, response_message
from kvserve.server.context import (
    ServingContext,
    chat_flags,
    check_model,
    off_engine,
    render_chat,
    usage,
    usage_so_far,
)
from kvserve.server.errors import APIError
from kvserve.server.logprobs import chat_logprobs
from kvserve.server.streaming import (
    ChoiceDelta,
    collect_or_disconnect,
    sse,
    sse_response,
    stream_events,
)
from kvserve.server.tokenizer_pool import check_fits, text_bytes
from kvserve.server.validation import (
    add_engine_requests,
    check_constraint,
    check_prompt_ids,
    check_request,
    resolve_max_tokens,
    sampling_params,
)


def _echoed_text(req: p.ChatCompletionRequest) -> str:
    """What ``echo`` puts before each reply: the last message's text when it has the reply's
    role (vLLM): the assistant's, or with no generation prompt the last message's own role
    (the model continues that message). Empty without ``echo``; call after ``render_chat``
    (which rejects conflicting chat options)."""
    if not req.echo:
        return ""
    add_generation_prompt, _ = chat_flags(req)
    last = req.messages[-1]
    return last.text() if not add_generation_prompt or last.role == "assistant" else ""


def _chat_prompt(ctx: ServingContext, req: p.ChatCompletionRequest, plan: ChatPlan) -> list[int]:
    """Runs on a tokenizer thread: render the chat template and check the result."""
    ids = render_chat(ctx, req, plan)
    check_prompt_ids(ctx, ids, "messages")
    return ids


async def create_chat_completion(
    ctx: ServingContext, req: p.ChatCompletionRequest, raw: Request
) -> Response:
    """POST /v1/chat/completions."""
    check_model(ctx, req.model)
    check_request(ctx, req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs requires logprobs=true", param="top_logprobs")
    plan = plan_chat(req)
    size = text_bytes(*(m.text() for m in req.messages))
    # NOTE: the template renders every message's text (and adds its own markup).
    check_fits(ctx.max_prompt_bytes, size, "messages")
    ids = await off_engine(ctx, lambda: _chat_prompt(ctx, req, plan), size)
    await check_constraint(ctx, plan.constraint, plan.constraint_param)
    if req.max_completion_tokens is not None:
        max_tokens = resolve_max_tokens(
            ctx, len(ids), req.max_completion_tokens, "max_completion_tokens"
        )
    else:
        max_tokens = resolve_max_tokens(ctx, len(ids), req.max_tokens, "max_tokens")
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(ctx, req, max_tokens, num_top, plan.constraint)
    echo = _echoed_text(req)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await add_engine_requests(ctx, request_id, [ids], [params], req)
    if req.stream:
        return sse_response(_chat_stream(ctx, req, request_id, ids, streams, num_top, plan, echo))
    finals = await collect_or_disconnect(raw, streams)
    choices = []
    for c in finals[0].outputs:
        message, finish_reason = response_message(plan, c.text, c.finish_reason)
        if echo:
            message.content = echo + (message.content or "")
        choices.append(
            p.ChatChoice(
                index=c.index,
                message=message,
                logprobs=chat_logprobs(ctx, c.token_ids, c.logprobs, 0, num_top),
                finish_reason=finish_reason,
                stop_reason=c.stop_reason,
            )
        )
    resp = p.ChatCompletionResponse(
        id=request_id, model=ctx.model_name, choices=choices, usage=usage([ids], finals)
    )
    return JSONResponse(p.dump(resp))


def _chat_stream(
    ctx: ServingContext,
    req: p.ChatCompletionRequest,
    request_id: str,
    prompt_ids: list[int],
    streams: list[RequestStream],
    num_top: int | None,
    plan: ChatPlan,
    echo: str,
) -> AsyncGenerator[str, None]:
    created = int(time.time())
    tool_streams = [ToolStream(plan) for _ in range(req.n)] if plan.tool_mode != "none" else None

    def chunk(choices: list[p.ChatStreamChoice], usage_info: p.UsageInfo | None = None) -> str:
        payload = p.dump(
            p.ChatCompletionChunk(
                id=request_id,
                created=created,
                model=ctx.model_name,
                choices=choices,
                usage=usage_info,
            )
        )
        for choice in payload["choices"]:
            # NOTE: OpenAI omits unset delta fields rather than sending nulls.
            choice["delta"] = drop_none(choice["delta"])
        return sse(payload)

    def choice_event(d: ChoiceDelta) -> str | None:
        c = d.completion
        delta: p.DeltaMessage | None = p.DeltaMessage(content=c.delta_text)
        finish_reason = c.finish_reason
        if tool_streams is not None:
            delta, finish_reason = tool_streams[c.index].delta(c.delta_text, c.finish_reason)
            if delta is None and not d.new_finish and num_top is None:
                return None  # held back (a possible tool-call tag): nothing to send yet
        choice = p.ChatStreamChoice(
            index=c.index,
            delta=delta or p.DeltaMessage(),
            logprobs=chat_logprobs(ctx, c.token_ids, c.logprobs, d.start, num_top),
            finish_reason=finish_reason,
        )
        if req.continuous_usage:
            return chunk([choice], usage_so_far(len(prompt_ids), len(c.token_ids)))
        return chunk([choice])

    opening = tuple(
        chunk([p.ChatStreamChoice(index=i, delta=p.DeltaMessage(role="assistant", content=echo))])
        for i in range(req.n)
    )
    return stream_events(
        streams,
        [prompt_ids],
        req.n,
        choice_event,
        with_logprobs=num_top is not None,
        usage_event=(lambda u: chunk([], u)) if req.include_usage else None,
        opening=opening,
    )
