"""POST /tokenize and /detokenize, as vLLM serves them."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from kvserve.server import protocol as p
from kvserve.server.chat_tools import ChatPlan
from kvserve.server.context import ServingContext, check_model, off_engine, render_chat
from kvserve.server.errors import APIError, from_validation_errors
from kvserve.server.tools import tools_as_dicts


async def tokenize(ctx: ServingContext, body: dict[str, Any]) -> Response:
    """``{"prompt": ...}`` or ``{"messages": [...]}`` -> count, max_model_len, tokens."""
    req: p.TokenizeCompletionRequest | p.TokenizeChatRequest
    try:
        if isinstance(body, dict) and "messages" in body:
            req = p.TokenizeChatRequest.model_validate(body)
        else:
            req = p.TokenizeCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise from_validation_errors(list(e.errors())) from e
    check_model(ctx, req.model)

    def run() -> list[int]:
        if isinstance(req, p.TokenizeCompletionRequest):
            return ctx.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        plan = ChatPlan(tool_mode="auto" if req.tools else "none")
        if req.tools:
            plan.tools = tools_as_dicts(req.tools)
        return render_chat(ctx, req, plan)

    if isinstance(req, p.TokenizeCompletionRequest):
        size = len(req.prompt)
    else:
        size = sum(len(m.text()) for m in req.messages)
    ids = await off_engine(ctx, run, size)
    strs = None
    if req.return_token_strs:
        strs = [ctx.token_text(t) for t in ids]
    resp = p.TokenizeResponse(
        count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs
    )
    return JSONResponse(p.dump(resp))


async def detokenize(ctx: ServingContext, req: p.DetokenizeRequest) -> Response:
    """``{"tokens": [...]}`` -> ``{"prompt": text}``; ids outside the vocabulary are a 400."""
    check_model(ctx, req.model)
    for t in req.tokens:
        if not 0 <= t < ctx.vocab_size:
            raise APIError(
                f"tokens: token id {t} is outside the vocabulary [0, {ctx.vocab_size})",
                param="tokens",
            )
    # NOTE: special tokens kept, as vLLM's /detokenize: /tokenize's ids come back as sent.
    decode = ctx.tokenizer.decode
    ids = req.tokens
    text = await off_engine(ctx, lambda: decode(ids, skip_special_tokens=False), len(ids))
    return JSONResponse(p.dump(p.DetokenizeResponse(prompt=text)))
