"""OpenAI request -> engine requests -> OpenAI response (JSON or SSE stream).

Validation that needs the model (prompt length, vocabulary, context) happens here and names
the offending field; everything else is checked by protocol.py and SamplingParams.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from kvserve.core.outputs import LogprobsEntry
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server import protocol as p
from kvserve.server.chat_tools import (
    ChatPlan,
    ToolStream,
    drop_none,
    plan_chat,
    prompt_messages,
    response_message,
    structured_params,
)
from kvserve.server.errors import APIError, from_value_error
from kvserve.structured.spec import StructuredOutputsParams

MAX_SEED = 2**63 - 1 - 1024  # NOTE: room for seed + sample_index in the sampler's generator
MAX_CHOICES = 256  # prompts x n in one request


@dataclass
class ServingContext:
    """What the handlers need from the engine, fixed at start-up."""

    engine: AsyncLLMEngine
    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any
    max_total_tokens: int  # min(max_model_len, KV pool capacity in tokens)
    chat_template: str | None = None  # --chat-template: replaces the model's template
    tool_call_parser: str = "hermes"  # --tool-call-parser
    # Compiles a structured-output constraint (ValueError if invalid); runs on the engine
    # thread. None: the engine has no structured output (test engines).
    validate_constraint: Callable[[StructuredOutputsParams], None] | None = None

    def __post_init__(self) -> None:
        self.token_text = functools.lru_cache(maxsize=65536)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


# ---- validation -----------------------------------------------------------------------------


def check_model(ctx: ServingContext, model: str | None) -> None:
    """404 unless ``model`` is the served model (None means the served model)."""
    if model is not None and model != ctx.model_name:
        raise APIError(
            f"the model {model!r} does not exist; this server serves {ctx.model_name!r}",
            status_code=404,
            param="model",
            code="model_not_found",
        )


def _check_prompt_ids(ctx: ServingContext, token_ids: list[int], param: str) -> None:
    if not token_ids:
        raise APIError(f"{param} is empty", param=param)
    for t in token_ids:
        if not 0 <= t < ctx.vocab_size:
            raise APIError(
                f"{param} token id {t} is outside the vocabulary [0, {ctx.vocab_size})",
                param=param,
            )
    if len(token_ids) >= ctx.max_model_len:
        raise APIError(
            f"{param} has {len(token_ids)} tokens, but this model's context length is "
            f"{ctx.max_model_len} (and at least one token must be generated)",
            param=param,
            code="context_length_exceeded",
        )


def _resolve_max_tokens(
    ctx: ServingContext, num_prompt_tokens: int, max_tokens: int | None, param: str
) -> int:
    if max_tokens is None:
        return max(1, ctx.max_total_tokens - num_prompt_tokens)
    if num_prompt_tokens + max_tokens > ctx.max_model_len:
        raise APIError(
            f"{param}={max_tokens} plus the prompt's {num_prompt_tokens} tokens exceeds this "
            f"model's context length {ctx.max_model_len}; lower {param}",
            param=param,
            code="context_length_exceeded",
        )
    return max_tokens


def _logit_bias(ctx: ServingContext, bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token id strings -> bias) with every id checked."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            message = f"logit_bias key {key!r} is not a token id"
            raise APIError(message, param="logit_bias") from None
        if not 0 <= token_id < ctx.vocab_size:
            raise APIError(
                f"logit_bias token id {token_id} is outside the vocabulary [0, {ctx.vocab_size})",
                param="logit_bias",
            )
        out[token_id] = value
    return out


async def _check_constraint(
    ctx: ServingContext, constraint: StructuredOutputsParams | None, param: str | None
) -> None:
    """Compile the constraint now (cached), so a bad schema/regex/grammar is a 400 naming
    the problem before anything is queued."""
    if constraint is None or ctx.validate_constraint is None:
        return
    check = ctx.validate_constraint
    try:
        await off_engine(ctx, lambda: check(constraint))
    except ValueError as e:
        raise APIError(str(e), param=param) from e


def _sampling_params(
    ctx: ServingContext,
    req: p.SamplingRequest,
    max_tokens: int,
    logprobs: int | None,
    constraint: StructuredOutputsParams | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise APIError(f"seed must be in [0, {MAX_SEED}]", param="seed")
    if req.top_k is not None and req.top_k > ctx.vocab_size:
        raise APIError(f"top_k must be <= the vocabulary size {ctx.vocab_size}", param="top_k")
    logit_bias = _logit_bias(ctx, req.logit_bias)
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    if stop is not None and any(not s for s in stop):
        raise APIError("stop strings must be non-empty", param="stop")
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=stop or None,
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            logit_bias=logit_bias,
            structured_outputs=constraint,
            prompt_logprobs=prompt_logprobs,
        )
    except ValueError as e:
        raise from_value_error(e) from e


async def _add_all(
    ctx: ServingContext,
    base_id: str,
    prompts: list[list[int]],
    params_list: list[SamplingParams],
    req: p.SamplingRequest,
) -> list[RequestStream]:
    """Queue one engine request per prompt; on any failure abort the ones already queued."""
    streams: list[RequestStream] = []
    try:
        for i, (ids, params) in enumerate(zip(prompts, params_list, strict=True)):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            streams.append(
                await ctx.engine.add_request(
                    ids, params, request_id=rid, priority=req.priority, cache_salt=req.cache_salt
                )
            )
    except BaseException as e:
        for s in streams:
            s.abort()
        if isinstance(e, ValueError):
            raise from_value_error(e) from e
        raise
    return streams


def engine_error(e: BaseException) -> APIError:
    """The API error for an async-engine failure."""
    if isinstance(e, QueueFullError):
        return APIError(str(e), status_code=503, code="queue_full")
    if isinstance(e, EngineDeadError):
        return APIError(str(e), status_code=503, code="engine_dead")
    if isinstance(e, RequestFailedError):
        return APIError(str(e), status_code=500, code="request_failed")
    return APIError(f"internal error: {e!r}", status_code=500)


# ---- completions ----------------------------------------------------------------------------


def _completion_prompts(ctx: ServingContext, req: p.CompletionRequest) -> list[list[int]]:
    """Runs on a tokenizer thread: tokenize and check every prompt of the batch."""
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]  # type: ignore[list-item]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if not items:
        raise APIError("prompt is empty", param="prompt")
    if len(items) * req.n > MAX_CHOICES:
        raise APIError(f"prompts x n must be <= {MAX_CHOICES}", param="n")
    out = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise APIError("prompt is empty", param="prompt")
            ids = ctx.tokenizer.encode(item)
        else:
            ids = list(item)
        _check_prompt_ids(ctx, ids, "prompt")
        out.append(ids)
    return out


async def create_completion(
    ctx: ServingContext, req: p.CompletionRequest, raw: Request
) -> Response:
    """POST /v1/completions."""
    check_model(ctx, req.model)
    if req.suffix:
        raise APIError("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of must equal n (best-of sampling is not supported)", param="best_of")
    prompts = await off_engine(ctx, lambda: _completion_prompts(ctx, req))
    constraint = _completion_constraint(req)
    await _check_constraint(ctx, constraint, "structured_outputs")
    # NOTE: echo with logprobs reports the prompt tokens' logprobs too (OpenAI).
    prompt_lps = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_lps = max(req.logprobs, prompt_lps or 0)
    params_list = [
        _sampling_params(
            ctx,
            req,
            _resolve_max_tokens(ctx, len(ids), req.max_tokens, "max_tokens"),
            req.logprobs,
            constraint,
            prompt_lps,
        )
        for ids in prompts
    ]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await _add_engine_requests(ctx, request_id, prompts, params_list, req)
    if req.stream:
        return sse_response(_completion_stream(ctx, req, request_id, prompts, streams))
    finals = await collect_or_disconnect(raw, streams)
    choices = [
        _with_prompt_parts(
            ctx,
            req,
            out,
            p.CompletionChoice(
                index=i * req.n + c.index,
                text=c.text,
                logprobs=_completion_logprobs(ctx, c.token_ids, c.logprobs, 0, req.logprobs),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            ),
        )
        for i, out in enumerate(finals)
        for c in out.outputs
    ]
    resp = p.CompletionResponse(
        id=request_id, model=ctx.model_name, choices=choices, usage=_usage(prompts, finals)
    )
    return JSONResponse(p.dump(resp))


async def _completion_stream(
    ctx: ServingContext,
    req: p.CompletionRequest,
    request_id: str,
    prompts: list[list[int]],
    streams: list[RequestStream],
) -> AsyncIterator[str]:
    created = _now()
    finals: list[RequestOutput | None] = [None] * len(streams)
    sent_finish: set[int] = set()
    echoed: set[int] = set()
    async with aclosing(merge_streams(streams)) as merged:
        async for i, out in merged:
            finals[i] = out
            for c in out.outputs:
                index = i * req.n + c.index
                new_finish = c.finish_reason is not None and index not in sent_finish
                if not (
                    c.delta_text or (req.logprobs is not None and c.delta_token_ids) or new_finish
                ):
                    continue
                if new_finish:
                    sent_finish.add(index)
                start = len(c.token_ids) - len(c.delta_token_ids)
                choice = p.CompletionChoice(
                    index=index,
                    text=c.delta_text,
                    logprobs=_completion_logprobs(
                        ctx, c.token_ids, c.logprobs, start, req.logprobs
                    ),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                if index not in echoed:  # the first chunk of a choice carries the prompt parts
                    echoed.add(index)
                    choice = _with_prompt_parts(ctx, req, out, choice)
                chunk = p.CompletionResponse(
                    id=request_id, created=created, model=ctx.model_name, choices=[choice]
                )
                yield _sse(p.dump(chunk))
    if req.include_usage:
        usage = _usage(prompts, [f for f in finals if f is not None])
        chunk = p.CompletionResponse(
            id=request_id, created=created, model=ctx.model_name, choices=[], usage=usage
        )
        yield _sse(p.dump(chunk))


def _completion_logprobs(
    ctx: ServingContext,
    token_ids: list[int],
    entries: list[LogprobsEntry] | None,
    start: int,
    num_top: int | None,
) -> p.CompletionLogProbs | None:
    if num_top is None or entries is None:
        return None
    out = p.CompletionLogProbs()
    offset = 0
    for tid, entry in zip(token_ids[start:], entries[start:], strict=False):
        text = ctx.token_text(tid)
        chosen = entry.get(tid)
        out.tokens.append(text)
        out.token_logprobs.append(chosen.logprob if chosen is not None else None)
        out.top_logprobs.append(
            {ctx.token_text(t): lp.logprob for t, lp in _top(entry, num_top)} if num_top else None
        )
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _completion_constraint(req: p.CompletionRequest) -> StructuredOutputsParams | None:
    if req.structured_outputs is None:
        return None
    try:
        return structured_params(req.structured_outputs)
    except ValueError as e:
        raise APIError(str(e), param="structured_outputs") from e


def _with_prompt_parts(
    ctx: ServingContext, req: p.CompletionRequest, out: RequestOutput, choice: p.CompletionChoice
) -> p.CompletionChoice:
    """``choice`` with echo (prompt text, and its logprobs when logprobs are asked) and
    vLLM's ``prompt_logprobs`` added, as the request asks."""
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
    prompt_text = (
        out.prompt if out.prompt is not None else ctx.tokenizer.decode(out.prompt_token_ids)
    )
    choice.text = prompt_text + choice.text
    if choice.logprobs is not None and lps is not None:
        head = _completion_logprobs(
            ctx, out.prompt_token_ids, [e or {} for e in lps], 0, req.logprobs
        )
        assert head is not None
        head.token_logprobs[0] = None
        head.top_logprobs[0] = None
        shift = len(prompt_text)
        head.tokens += choice.logprobs.tokens
        head.token_logprobs += choice.logprobs.token_logprobs
        head.top_logprobs += choice.logprobs.top_logprobs
        head.text_offset += [o + shift for o in choice.logprobs.text_offset]
        choice.logprobs = head
    return choice


# ---- chat -----------------------------------------------------------------------------------


def _chat_prompt(
    ctx: ServingContext, req: p.ChatCompletionRequest, plan: ChatPlan | None = None
) -> list[int]:
    """Runs on a tokenizer thread: render the chat template and check the result."""
    template = ctx.chat_template or getattr(ctx.tokenizer, "chat_template", None)
    messages, extra = prompt_messages(req, plan or ChatPlan(), template)
    if ctx.chat_template is not None:
        extra["chat_template"] = ctx.chat_template
    try:
        ids = ctx.tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, **extra
        )
    except ValueError as e:
        raise APIError(str(e), param="messages") from e
    _check_prompt_ids(ctx, ids, "messages")
    return ids


async def create_chat_completion(
    ctx: ServingContext, req: p.ChatCompletionRequest, raw: Request
) -> Response:
    """POST /v1/chat/completions."""
    check_model(ctx, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs requires logprobs=true", param="top_logprobs")
    plan = plan_chat(req)
    ids = await off_engine(ctx, lambda: _chat_prompt(ctx, req, plan))
    await _check_constraint(ctx, plan.constraint, plan.constraint_param)
    if req.max_completion_tokens is not None:
        max_tokens = _resolve_max_tokens(
            ctx, len(ids), req.max_completion_tokens, "max_completion_tokens"
        )
    else:
        max_tokens = _resolve_max_tokens(ctx, len(ids), req.max_tokens, "max_tokens")
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling_params(ctx, req, max_tokens, num_top, plan.constraint)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await _add_engine_requests(ctx, request_id, [ids], [params], req)
    if req.stream:
        return sse_response(_chat_stream(ctx, req, request_id, ids, streams[0], num_top, plan))
    finals = await collect_or_disconnect(raw, streams)
    choices = []
    for c in finals[0].outputs:
        message, finish_reason = response_message(plan, c.text, c.finish_reason)
        choices.append(
            p.ChatChoice(
                index=c.index,
                message=message,
                logprobs=_chat_logprobs(ctx, c.token_ids, c.logprobs, 0, num_top),
                finish_reason=finish_reason,
                stop_reason=c.stop_reason,
            )
        )
    resp = p.ChatCompletionResponse(
        id=request_id, model=ctx.model_name, choices=choices, usage=_usage([ids], finals)
    )
    return JSONResponse(p.dump(resp))


async def _chat_stream(
    ctx: ServingContext,
    req: p.ChatCompletionRequest,
    request_id: str,
    prompt_ids: list[int],
    stream: RequestStream,
    num_top: int | None,
    plan: ChatPlan | None = None,
) -> AsyncIterator[str]:
    created = _now()
    tool_streams = (
        [ToolStream(plan) for _ in range(req.n)]
        if plan is not None and plan.tool_mode != "none"
        else None
    )

    def chunk(choices: list[p.ChatStreamChoice], usage: p.UsageInfo | None = None) -> str:
        payload = p.dump(
            p.ChatCompletionChunk(
                id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage
            )
        )
        for choice in payload["choices"]:
            # NOTE: OpenAI omits unset delta fields rather than sending nulls.
            choice["delta"] = drop_none(choice["delta"])
        return _sse(payload)

    for i in range(req.n):
        delta = p.DeltaMessage(role="assistant", content="")
        yield chunk([p.ChatStreamChoice(index=i, delta=delta)])
    final: RequestOutput | None = None
    sent_finish: set[int] = set()
    async with aclosing(merge_streams([stream])) as merged:
        async for _, out in merged:
            final = out
            for c in out.outputs:
                new_finish = c.finish_reason is not None and c.index not in sent_finish
                if not (c.delta_text or (num_top is not None and c.delta_token_ids) or new_finish):
                    continue
                if new_finish:
                    sent_finish.add(c.index)
                start = len(c.token_ids) - len(c.delta_token_ids)
                delta: p.DeltaMessage | None = p.DeltaMessage(content=c.delta_text)
                finish_reason = c.finish_reason
                if tool_streams is not None:
                    delta, finish_reason = tool_streams[c.index].delta(
                        c.delta_text, c.finish_reason
                    )
                    if delta is None and not new_finish and num_top is None:
                        continue  # held back (a possible tool-call tag): nothing to send yet
                choice = p.ChatStreamChoice(
                    index=c.index,
                    delta=delta or p.DeltaMessage(),
                    logprobs=_chat_logprobs(ctx, c.token_ids, c.logprobs, start, num_top),
                    finish_reason=finish_reason,
                )
                yield chunk([choice])
    if req.include_usage:
        yield chunk([], _usage([prompt_ids], [final] if final is not None else []))


def _chat_logprobs(
    ctx: ServingContext,
    token_ids: list[int],
    entries: list[LogprobsEntry] | None,
    start: int,
    num_top: int | None,
) -> p.ChatLogProbs | None:
    if num_top is None or entries is None:
        return None
    content = []
    for tid, entry in zip(token_ids[start:], entries[start:], strict=False):
        text = ctx.token_text(tid)
        chosen = entry.get(tid)
        content.append(
            p.ChatTokenLogprob(
                token=text,
                logprob=chosen.logprob if chosen is not None else float("-inf"),
                bytes=list(text.encode()),
                top_logprobs=[
                    p.TopLogprob(
                        token=ctx.token_text(t),
                        logprob=lp.logprob,
                        bytes=list(ctx.token_text(t).encode()),
                    )
                    for t, lp in _top(entry, num_top)
                ],
            )
        )
    return p.ChatLogProbs(content=content)


# ---- shared helpers -------------------------------------------------------------------------


def _top(entry: LogprobsEntry, num_top: int) -> list[tuple[int, Any]]:
    return sorted(entry.items(), key=lambda kv: kv[1].rank)[:num_top]


def _usage(prompts: list[list[int]], finals: list[RequestOutput]) -> p.UsageInfo:
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
    pool, never on the engine thread: a huge prompt delays only its own request."""
    if ctx.engine.is_dead:
        raise engine_error(EngineDeadError(f"the engine loop has died: {ctx.engine.dead_error!r}"))
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZER_THREADS, fn)


async def _add_engine_requests(
    ctx: ServingContext,
    request_id: str,
    prompts: list[list[int]],
    params_list: list[SamplingParams],
    req: p.SamplingRequest,
) -> list[RequestStream]:
    try:
        return await _add_all(ctx, request_id, prompts, params_list, req)
    except (QueueFullError, EngineDeadError) as e:
        raise engine_error(e) from e


async def merge_streams(
    streams: list[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(stream index, output)`` from several streams as outputs arrive.

    Every stream still open is aborted when the consumer stops early (close, cancel, error).
    """
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            num_open = len(streams)
            while num_open:
                i, item = await queue.get()
                if item is None:
                    num_open -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for s in streams:
            s.abort()


async def collect_or_disconnect(raw: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of every stream; aborts them all if the client disconnects first."""

    async def collect() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async with aclosing(merge_streams(streams)) as merged:
            async for i, out in merged:
                finals[i] = out
        return [f for f in finals if f is not None]

    collector = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(_wait_disconnect(raw.receive))
    try:
        done, _ = await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if collector not in done:
            collector.cancel()
            raise APIError("client disconnected", status_code=499, code="client_disconnected")
        try:
            return collector.result()
        except (QueueFullError, EngineDeadError) as e:
            raise APIError(str(e), status_code=500, code="engine_dead") from e
        except RequestFailedError as e:
            raise engine_error(e) from e
    finally:
        watcher.cancel()
        collector.cancel()
        for s in streams:
            s.abort()


async def _wait_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    # NOTE: the body has been read already, so the next ASGI message is http.disconnect.
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _now() -> int:
    return int(time.time())


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so an early disconnect (or any
    other exit) aborts the requests behind it right away, not at garbage collection."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def sse_response(events: AsyncIterator[str]) -> Response:
    """Stream ``events`` as Server-Sent Events, ending with ``data: [DONE]``."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except (EngineDeadError, QueueFullError) as e:
            yield _sse(APIError(str(e), status_code=500, code="engine_dead").body())
        except RequestFailedError as e:
            yield _sse(engine_error(e).body())
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()
        yield "data: [DONE]\n\n"

    return _SSEResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
