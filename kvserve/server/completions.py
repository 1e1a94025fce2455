"""POST /v1/completions: a prompt (or a batch) -> engine requests -> JSON or an SSE stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from typing import cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvserve.engine.async_engine import RequestStream
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.server import protocol as p
from kvserve.server.chat_tools import response_format_params, structured_params
from kvserve.server.context import ServingContext, check_model, off_engine, usage, usage_so_far
from kvserve.server.errors import APIError
from kvserve.server.logprobs import completion_logprobs
from kvserve.server.streaming import (
    ChoiceDelta,
    collect_or_disconnect,
    sse,
    sse_response,
    stream_events,
)
from kvserve.server.tokenizer_pool import check_fits, text_bytes
from kvserve.server.validation import (
    MAX_CHOICES,
    add_engine_requests,
    check_constraint,
    check_prompt_ids,
    check_request,
    resolve_max_tokens,
    sampling_params,
)
from kvserve.structured.spec import StructuredOutputsParams


async def create_completion(
    ctx: ServingContext, req: p.CompletionRequest, raw: Request
) -> Response:
    """POST /v1/completions."""
    check_model(ctx, req.model)
    check_request(ctx, req)
    if req.suffix:
        raise APIError("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of must equal n (best-of sampling is not supported)", param="best_of")
    if req.max_tokens == 0 and not req.echo:
        raise APIError(
            "max_tokens must be >= 1 (0 only with echo: the prompt scored, nothing generated)",
            param="max_tokens",
        )
    scoring = req.max_tokens == 0  # echo only: the prompt and its logprobs, nothing generated
    max_tokens = req.max_tokens
    model_max = ctx.sampling_defaults.get("max_tokens")
    if "max_tokens" not in req.model_fields_set and model_max is not None:
        # NOTE: OpenAI's default 16, capped by the model's max_new_tokens, as vLLM does.
        max_tokens = min(max_tokens or model_max, model_max)
    size = _prompt_bytes(ctx, req)
    texts, prompts = await off_engine(ctx, lambda: _completion_prompts(ctx, req), size)
    constraint, constraint_param = _completion_constraint(req)
    await check_constraint(ctx, constraint, constraint_param)
    # NOTE: echo with logprobs reports the prompt tokens' logprobs too (OpenAI).
    prompt_lps = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_lps = max(req.logprobs, prompt_lps or 0)
    params_list = [
        sampling_params(
            ctx,
            req,
            # NOTE: echo with max_tokens 0 scores the prompt: one token is generated (the
            # engine samples after every prefill) and left out of the answer, as vLLM does.
            resolve_max_tokens(ctx, len(ids), 1 if scoring else max_tokens, "max_tokens"),
            req.logprobs,
            constraint,
            prompt_lps,
        )
        for ids in prompts
    ]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await add_engine_requests(ctx, request_id, prompts, params_list, req)
    if req.stream:
        return sse_response(_completion_stream(ctx, req, request_id, prompts, texts, streams))
    finals = await collect_or_disconnect(raw, streams)
    choices = [
        _with_prompt_parts(
            ctx,
            req,
            out,
            texts[i],
            _choice(ctx, req, i * req.n + c.index, c, c.text, 0, scoring),
        )
        for i, out in enumerate(finals)
        for c in out.outputs
    ]
    total = usage(prompts, finals)
    resp = p.CompletionResponse(
        id=request_id,
        model=ctx.model_name,
        choices=choices,
        usage=_prompt_only(total) if scoring else total,
    )
    return JSONResponse(p.dump(resp))


def _choice(
    ctx: ServingContext,
    req: p.CompletionRequest,
    index: int,
    c: CompletionOutput,
    text: str,
    start: int,
    scoring: bool,
    offset: int = 0,
) -> p.CompletionChoice:
    """The choice ``index`` with ``text`` and the logprobs of ``c.token_ids[start:]``
    (their ``text_offset`` from ``offset``); ``scoring`` (echo, max_tokens 0): nothing of
    what was generated, finished for its length."""
    ids = [] if scoring else c.token_ids
    return p.CompletionChoice(
        index=index,
        text="" if scoring else text,
        logprobs=completion_logprobs(ctx, ids, c.logprobs, start, req.logprobs, offset),
        finish_reason="length" if scoring and c.finish_reason else c.finish_reason,
        stop_reason=None if scoring else c.stop_reason,
    )


def _prompt_only(total: p.UsageInfo) -> p.UsageInfo:
    """``total`` without its generated tokens (a scored prompt's one sampled token)."""
    return total.model_copy(update={"completion_tokens": 0, "total_tokens": total.prompt_tokens})


def _prompt_bytes(ctx: ServingContext, req: p.CompletionRequest) -> int:
    """The bytes of text of the request's prompts; a 400 for one too long to fit in the
    context, before any is tokenized (``tokenizer_pool.check_fits``)."""
    prompt = req.prompt
    texts = [prompt] if isinstance(prompt, str) else [t for t in prompt if isinstance(t, str)]
    for text in texts:
        # NOTE: len(text) <= its bytes: a short text is not encoded to be measured.
        if ctx.max_prompt_bytes is not None and len(text) * 4 > ctx.max_prompt_bytes:
            check_fits(ctx.max_prompt_bytes, text_bytes(text), "prompt")
    return sum(len(t) for t in texts)


def _completion_prompts(
    ctx: ServingContext, req: p.CompletionRequest
) -> tuple[list[str | None], list[list[int]]]:
    """Runs on a tokenizer thread: tokenize and check every prompt of the batch. Returns each
    prompt as the request spelled it (None: given as token ids) and its token ids."""
    prompt = req.prompt
    items: list[str | list[int]]
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [cast("list[int]", prompt)]  # NOTE: pydantic made the list all ints
    else:
        items = list(cast("list[str] | list[list[int]]", prompt))
    if not items:
        raise APIError("prompt is empty", param="prompt")
    if len(items) * req.n > MAX_CHOICES:
        raise APIError(f"prompts x n must be <= {MAX_CHOICES}", param="n")
    texts: list[str | None] = []
    out = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise APIError("prompt is empty", param="prompt")
            ids = ctx.tokenizer.encode(item)
        else:
            ids = list(item)
        check_prompt_ids(ctx, ids, "prompt")
        texts.append(item if isinstance(item, str) else None)
        out.append(ids)
    return texts, out


def _completion_stream(
    ctx: ServingContext,
    req: p.CompletionRequest,
    request_id: str,
    prompts: list[list[int]],
    texts: list[str | None],
    streams: list[RequestStream],
) -> AsyncGenerator[str, None]:
    created = int(time.time())
    scoring = req.max_tokens == 0
    # Each choice's text sent so far (chars): where its next tokens' text_offset starts.
    sent: dict[int, int] = {}

    def chunk(choices: list[p.CompletionChoice], usage_info: p.UsageInfo | None = None) -> str:
        resp = p.CompletionResponse(
            id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage_info
        )
        return sse(p.dump(resp))

    def choice_event(d: ChoiceDelta) -> str:
        c = d.completion
        before = sent.get(d.index)
        choice = _choice(ctx, req, d.index, c, c.delta_text, d.start, scoring, before or 0)
        if before is None:  # the first chunk of a choice carries the prompt parts
            choice = _with_prompt_parts(ctx, req, d.output, texts[d.index // req.n], choice)
        sent[d.index] = (before or 0) + len(choice.text)
        if req.continuous_usage:
            generated = 0 if scoring else len(c.token_ids)
            return chunk([choice], usage_so_far(len(prompts[d.index // req.n]), generated))
        return chunk([choice])

    return stream_events(
        streams,
        prompts,
        req.n,
        choice_event,
        with_logprobs=req.logprobs is not None,
        usage_event=(lambda u: chunk([], _prompt_only(u) if scoring else u))
        if req.include_usage
        else None,
    )


def _completion_constraint(
    req: p.CompletionRequest,
) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field it came from: vLLM's
    ``structured_outputs`` or ``response_format`` (vLLM takes it on completions too)."""
    fmt = (
        req.response_format if req.response_format and req.response_format.type != "text" else None
    )
    if fmt is not None and req.structured_outputs is not None:
        raise APIError(
            "only one output constraint per request: got response_format and structured_outputs",
            param="structured_outputs",
        )
    param = "response_format" if fmt is not None else "structured_outputs"
    try:
        if fmt is not None:
            return response_format_params(fmt), param
        if req.structured_outputs is not None:
            return structured_params(req.structured_outputs), param
    except ValueError as e:
        raise APIError(str(e), param=param) from e
    return None, None


def _with_prompt_parts(
    ctx: ServingContext,
    req: p.CompletionRequest,
    out: RequestOutput,
    prompt_text: str | None,
    choice: p.CompletionChoice,
) -> p.CompletionChoice:
    """``choice`` with echo (prompt text, and its logprobs when logprobs are asked) and
    vLLM's ``prompt_logprobs`` added, as the request asks. ``prompt_text``: the prompt as
    the request spelled it, echoed as is; None (token ids): their text, special tokens kept."""
    lps = out.prompt_logprobs
    if req.prompt_logprobs is not None and lps is not None:
        num_top = req.prompt_logprobs
        choice.prompt_logprobs = [
            None
            if entry is None
            else {
                str(t): p.PromptLogprob(
                    logprob=lp.logprob, rank=lp.rank, decoded_token=ctx.token_text(t)
                )
                for t, lp in entry.items()
                if t == tid or lp.rank <= num_top
            }
            for tid, entry in zip(out.prompt_token_ids, lps, strict=False)
        ]
    if not req.echo:
        return choice
    if prompt_text is None:
        prompt_text = ctx.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    choice.text = prompt_text + choice.text
    if choice.logprobs is None:
        return choice
    tail = choice.logprobs
    tail.text_offset = [o + len(prompt_text) for o in tail.text_offset]
    if lps is not None:
        head = completion_logprobs(
            ctx, out.prompt_token_ids, [e or {} for e in lps], 0, req.logprobs
        )
        assert head is not None
        head.token_logprobs[0] = None
        head.top_logprobs[0] = None
        head.tokens += tail.tokens
        head.token_logprobs += tail.token_logprobs
        head.top_logprobs += tail.top_logprobs
        head.text_offset += tail.text_offset
        choice.logprobs = head
    return choice
