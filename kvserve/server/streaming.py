"""Engine streams -> responses: the one streaming path of chat and completions (SSE), the
collection of final outputs for non-streaming responses, and the client-disconnect abort.

An engine failure, streaming or not, is answered through ``errors.engine_error``: before the
first byte as an HTTP status, inside a stream as an error event followed by ``[DONE]``. A
request that failed with its output (finish reason "error": a grammar-engine limit) is a
non-streamed answer's choice, with its text so far, and a stream's error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.engine.async_engine import RequestFailedError, RequestStream
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.server import protocol as p
from kvserve.server.context import usage
from kvserve.server.errors import ENGINE_ERRORS, APIError, engine_error

logger = logging.getLogger("kvserve.server")


@dataclass
class ChoiceDelta:
    """What one choice of a streamed response got since its last chunk: one engine step, or
    several merged (``RequestStream``) when the client reads slower than the engine steps."""

    index: int  # the choice's index in the response: prompt index * n + sample index
    output: RequestOutput  # its request's output (of the latest of those steps)
    completion: CompletionOutput
    start: int  # the first new token in completion.token_ids
    new_finish: bool  # the choice finished in those steps


async def stream_events(
    streams: list[RequestStream],
    prompts: list[list[int]],
    n: int,
    choice_event: Callable[[ChoiceDelta], str | None],
    *,
    with_logprobs: bool,
    usage_event: Callable[[p.UsageInfo], str] | None = None,
    opening: tuple[str, ...] = (),
) -> AsyncGenerator[str, None]:
    """The SSE events of a streamed chat or completion response.

    ``opening`` events first; then, as steps arrive, ``choice_event`` of every choice that got
    text, tokens whose logprobs are asked for, or its finish (it returns None to send
    nothing); then, with ``usage_event``, the usage of the whole response.
    """
    for event in opening:
        yield event
    finals: list[RequestOutput | None] = [None] * len(streams)
    sent_finish: set[int] = set()
    async with aclosing(merge_streams(streams)) as merged:
        async for i, out in merged:
            if out.failed_with_output:
                # NOTE: a request that finished with "error" (a grammar-engine limit) keeps
                # its text in a non-streamed answer; a stream ends with an error event, as for
                # any failed request (sse_response), never with a finish that looks complete.
                raise RequestFailedError(out.error)
            finals[i] = out
            for c in out.outputs:
                index = i * n + c.index
                new_finish = c.finish_reason is not None and index not in sent_finish
                if not (c.delta_text or (with_logprobs and c.delta_token_ids) or new_finish):
                    continue
                if new_finish:
                    sent_finish.add(index)
                start = len(c.token_ids) - len(c.delta_token_ids)
                event = choice_event(ChoiceDelta(index, out, c, start, new_finish))
                if event is not None:
                    yield event
    if usage_event is not None:
        yield usage_event(usage(prompts, [f for f in finals if f is not None]))


async def merge_streams(
    streams: list[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(stream index, output)`` from several streams as outputs arrive.

    An output is taken from its stream only when the consumer asks for the next one, so the
    steps of a slow consumer merge in the streams (``RequestStream``) rather than queueing
    here. Every stream still open is aborted when the consumer stops early (close, cancel,
    error).
    """
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        # NOTE: aclosing: an early stop cancels the waiter tasks now, not at garbage collection.
        async with aclosing(_take_when_ready(streams)) as items:
            async for item in items:
                yield item
    finally:
        for s in streams:
            s.abort()


async def _take_when_ready(
    streams: list[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``merge_streams`` of several streams: wait until some are ready, then take and yield
    their outputs one at a time (a stream's error is raised)."""
    # NOTE: waiters only watch; the output is taken just before it is yielded, so what arrives
    # while the consumer is busy with another stream's output merges into the unread one.
    waiters = {i: asyncio.ensure_future(s.wait_ready()) for i, s in enumerate(streams)}
    try:
        while waiters:
            await asyncio.wait(waiters.values(), return_when=asyncio.FIRST_COMPLETED)
            for i in [i for i, w in waiters.items() if w.done()]:
                del waiters[i]
                try:
                    out = await streams[i].__anext__()  # ready: returns at once
                except StopAsyncIteration:
                    continue
                yield i, out
                if not streams[i].finished:
                    waiters[i] = asyncio.ensure_future(streams[i].wait_ready())
    finally:
        for w in waiters.values():
            w.cancel()


async def collect_or_disconnect(raw: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of every stream; aborts them all if the client disconnects first.
    An engine failure is raised as its API error (``errors.ENGINE_ERRORS``)."""

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
        except Exception as e:
            _log_unmapped(e)
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


def sse(payload: dict[str, Any]) -> str:
    """One SSE event carrying ``payload`` as compact JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so an early disconnect (or any
    other exit) aborts the requests behind it right away, not at garbage collection."""

    def __init__(self, body: AsyncGenerator[str, None], **kwargs: Any) -> None:
        super().__init__(body, **kwargs)
        self._body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()


def sse_response(events: AsyncGenerator[str, None]) -> Response:
    """Stream ``events`` as Server-Sent Events, ending with ``data: [DONE]``; an engine
    failure on the way becomes an error event (``errors.engine_error``) before it."""

    async def body() -> AsyncGenerator[str, None]:
        try:
            async for event in events:
                yield event
        except Exception as e:  # noqa: BLE001 - answered in the stream, as the map says
            _log_unmapped(e)
            yield sse(engine_error(e).body())
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"

    return _SSEResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _log_unmapped(e: Exception) -> None:
    """Log an exception the error map does not name (its text stays out of the response)."""
    if not isinstance(e, APIError) and not any(cls in ENGINE_ERRORS for cls in type(e).__mro__):
        logger.error("unhandled error while serving a request", exc_info=e)
