"""RequestStream holds at most one unread output: the steps a consumer does not read merge
into it (vLLM's RequestOutputCollector), so a stalled consumer costs the request's own size,
and reading later gives what reading every step would have given (fake engine)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

import pytest

from kvserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    RequestFailedError,
    RequestStream,
)
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.streaming import merge_streams
from tests.server.fake_engine import FakeEngine


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


async def _until(cond: Callable[[], bool]) -> None:
    """Wait until ``cond()`` holds (the test's overall timeout bounds the wait)."""
    while not cond():
        await asyncio.sleep(0.001)


async def _steps_pass(eng: AsyncLLMEngine, streams: list[RequestStream], num: int) -> None:
    """Wait until ``num`` more steps' worth of outputs (one per running stream a step) have
    been routed to ``streams``, or no request is left."""
    seen = sum(s.num_received for s in streams)
    goal = seen + num * len(streams)
    await _until(lambda: sum(s.num_received for s in streams) >= goal or not eng.num_unfinished)


def _every_step(prompt: str, params: SamplingParams) -> list[RequestOutput]:
    """What a consumer that reads every step gets: a fresh fake engine stepped by hand."""
    fake = FakeEngine(max_model_len=512, step_seconds=0)
    rid = fake.add_request(prompt, params)
    outs = []
    while fake.has_unfinished_requests():
        outs += [copy.deepcopy(o) for o in fake.step() if o.request_id == rid]
    return outs


def _assert_sums_up(merged: RequestOutput, steps: list[RequestOutput]) -> None:
    """``merged`` is the last of ``steps`` with each sample's deltas those of all ``steps``
    (metrics aside: the two runs' clocks differ)."""
    last = steps[-1]
    assert [c.index for c in merged.outputs] == [c.index for c in last.outputs]
    for got, want in zip(merged.outputs, last.outputs, strict=True):
        i = want.index
        assert got.delta_token_ids == [t for o in steps for t in o.outputs[i].delta_token_ids]
        assert got.delta_text == "".join(o.outputs[i].delta_text for o in steps)
        assert (got.text, got.token_ids, got.logprobs) == (want.text, want.token_ids, want.logprobs)
        assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
    assert (merged.finished, merged.prompt_token_ids, merged.error) == (
        last.finished,
        last.prompt_token_ids,
        last.error,
    )


def test_a_consumer_that_never_reads_holds_one_merged_output() -> None:
    """200 steps of an n=2 request with logprobs, nobody reading: one output is held
    throughout; read at the end it carries every step's tokens, text and logprobs."""
    params = SamplingParams(max_tokens=200, n=2, logprobs=3, seed=5)
    steps = _every_step("stalled", params)
    assert len(steps) == 200

    async def main() -> None:
        eng = AsyncLLMEngine(FakeEngine(max_model_len=512, step_seconds=0))
        stream = await eng.add_request("stalled", params)
        await _until(lambda: stream.num_received >= 50)
        assert stream.num_pending == 1 and stream.num_outputs == 0
        await _until(lambda: eng.num_unfinished == 0)  # its last step was routed
        assert stream.num_pending == 1 and stream.num_received == 200
        outs = [o async for o in stream]
        assert len(outs) == 1 and stream.num_outputs == 1 and outs[0].finished
        _assert_sums_up(outs[0], steps)
        (merged,) = outs
        for c in merged.outputs:
            assert c.delta_text == c.text and len(c.delta_token_ids) == 200
            assert c.logprobs is not None and len(c.logprobs) == 200
        await eng.shutdown()

    _run(main())


def test_a_finish_merges_into_the_unread_output() -> None:
    """Read a few steps, then stop reading: the rest (the finish included) comes as one
    output whose deltas continue where the last one read ended; then the stream ends."""
    params = SamplingParams(max_tokens=40, n=2, logprobs=1)
    steps = _every_step("later", params)

    async def main() -> None:
        eng = AsyncLLMEngine(FakeEngine(step_seconds=0))
        stream = await eng.add_request("later", params)
        first = [await stream.__anext__() for _ in range(3)]
        await _until(lambda: eng.num_unfinished == 0)
        rest = [o async for o in stream]
        assert len(rest) == 1 and rest[0].finished and stream.num_outputs == 4
        read = [*first, *rest]
        for i in range(2):
            assert "".join(o.outputs[i].delta_text for o in read) == steps[-1].outputs[i].text
        # what the first three reads took, the last one continues from
        done = sum(len(o.outputs[0].delta_token_ids) for o in first)
        _assert_sums_up(rest[0], steps[done:])
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        await eng.shutdown()

    _run(main())


def test_an_engine_death_comes_after_the_unread_output() -> None:
    """The loop dies while steps are unread: the consumer gets them (merged), then the
    EngineDeadError, then nothing."""

    async def main() -> None:
        fake = FakeEngine(step_seconds=0.001)
        eng = AsyncLLMEngine(fake)
        stream = await eng.add_request("abc", SamplingParams(max_tokens=200))
        first = await stream.__anext__()
        await _until(lambda: stream.num_received >= 10)
        fake.fail_next_step = True
        await _until(lambda: eng.is_dead)
        assert stream.num_pending == 2  # the merged output and the error
        pending = await stream.__anext__()
        assert not pending.finished
        c = pending.outputs[0]
        got = len(first.outputs[0].token_ids) + len(c.delta_token_ids)
        assert got == len(c.token_ids) == stream.num_received >= 10
        assert first.outputs[0].text + c.delta_text == c.text
        with pytest.raises(EngineDeadError):
            await stream.__anext__()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        await eng.shutdown()

    _run(main())


def test_a_request_failure_comes_after_the_unread_output() -> None:
    """The request fails on its own while a step is unread: that step first, then the
    RequestFailedError."""

    async def main() -> None:
        fake = FakeEngine(step_seconds=0.001)
        eng = AsyncLLMEngine(fake)
        stream = await eng.add_request("abc", SamplingParams(max_tokens=200), request_id="r")
        await _until(lambda: stream.num_received >= 5)
        fake.fail_request_ids.add("r")
        await _until(lambda: eng.num_unfinished == 0)
        out = await stream.__anext__()
        assert not out.finished and out.outputs[0].delta_text == out.outputs[0].text
        assert len(out.outputs[0].token_ids) == stream.num_received >= 5
        with pytest.raises(RequestFailedError, match="injected fault"):
            await stream.__anext__()
        await eng.shutdown()

    _run(main())


def test_abort_drops_the_unread_output_and_frees_the_request() -> None:
    async def main() -> None:
        fake = FakeEngine(step_seconds=0.001)
        eng = AsyncLLMEngine(fake)
        stream = await eng.add_request("abc", SamplingParams(max_tokens=200))
        await _until(lambda: stream.num_received >= 5)
        assert stream.num_pending == 1
        stream.abort()
        assert stream.num_pending == 0
        await eng.run_in_engine(lambda: None)  # the abort ran before this (FIFO)
        assert not fake.requests and fake.num_aborted == 1 and eng.num_unfinished == 0
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        await eng.shutdown()

    _run(main())


def test_abort_ends_a_consumer_waiting_on_the_stream() -> None:
    """A consumer blocked on an empty stream ends (StopAsyncIteration) when another task
    aborts the stream; the abort reaches the engine once."""
    aborted: list[RequestStream] = []

    async def main() -> None:
        stream = RequestStream("r", aborted.append)
        reader = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        assert not reader.done()
        stream.abort()
        stream.abort()
        with pytest.raises(StopAsyncIteration):
            await reader

    _run(main())
    assert len(aborted) == 1


def test_reading_several_streams_slowly_queues_nothing() -> None:
    """``merge_streams`` takes an output only when its consumer asks: with a consumer that
    lets several steps pass per output, each stream holds at most one (merged) output and the
    consumer gets fewer outputs than steps, with the same text in total."""

    async def main() -> None:
        eng = AsyncLLMEngine(FakeEngine(step_seconds=0.001))
        streams = [await eng.add_request(f"p{i}", SamplingParams(max_tokens=60)) for i in range(3)]
        texts = ["", "", ""]
        finals: list[RequestOutput | None] = [None, None, None]
        taken = 0
        async for i, out in merge_streams(streams):
            taken += 1
            texts[i] += out.outputs[0].delta_text
            finals[i] = out
            await _steps_pass(eng, streams, 3)  # a slow client
            assert all(s.num_pending <= 1 for s in streams)
        for text, final in zip(texts, finals, strict=True):
            assert final is not None and final.finished and text == final.outputs[0].text
            assert len(text) == 60
        # NOTE: every read but the last three (one per stream, after the end) let 3 steps
        # (9 outputs) pass: 180 outputs read one per step would be 180 reads.
        assert taken <= 180 // 9 + 1 + 3
        assert all(s.num_received == 60 for s in streams)
        await eng.shutdown()

    _run(main())


def test_closing_a_merge_of_several_streams_aborts_them_all() -> None:
    """A client gone mid-batch: closing ``merge_streams`` aborts every stream (the engine
    frees the requests) and leaves no task waiting on them."""

    async def main() -> None:
        fake = FakeEngine(step_seconds=0.001)
        eng = AsyncLLMEngine(fake)
        streams = [await eng.add_request(f"p{i}", SamplingParams(max_tokens=200)) for i in range(3)]
        merged = merge_streams(streams)
        await merged.__anext__()
        await merged.aclose()
        assert all(s.finished and s.num_pending == 0 for s in streams)
        await eng.run_in_engine(lambda: None)  # the aborts ran before this (FIFO)
        assert not fake.requests and fake.num_aborted == 3 and eng.num_unfinished == 0

        def waiting() -> list[asyncio.Task[Any]]:
            return [t for t in asyncio.all_tasks() if "wait_ready" in repr(t.get_coro())]

        await _until(lambda: not waiting())
        await eng.shutdown()

    _run(main())


def test_merge_keeps_the_newest_state_and_joins_the_deltas() -> None:
    """``put`` without a reader: the stream's one output is the newest output of the request
    (metrics, prompt logprobs, cached tokens included) with the deltas of every step."""
    fake = FakeEngine(step_seconds=0)
    params = SamplingParams(max_tokens=6, n=3, logprobs=2)
    rid = fake.add_request("xyz", params)
    steps: list[RequestOutput] = []
    stream = RequestStream(rid, lambda s: None)
    while fake.has_unfinished_requests():
        for out in fake.step():
            out.num_cached_tokens = len(steps)  # distinct per step: the newest must win
            steps.append(copy.deepcopy(out))
            stream.put(out)
    assert stream.num_pending == 1 and stream.num_received == len(steps) == 6

    async def read() -> list[RequestOutput]:
        return [o async for o in stream]

    (merged,) = _run(read())
    _assert_sums_up(merged, steps)
    assert merged.metrics == steps[-1].metrics and merged.num_cached_tokens == 5
