"""AsyncLLMEngine on a fake engine: routing, abort, validation, queue bound, loop death."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from kvserve.sampling_params import SamplingParams
from tests.server.fake_engine import FakeEngine


def _run(coro):  # noqa: ANN001, ANN202 - test helper
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_streams_deltas_until_finished() -> None:
    async def main() -> None:
        fake = FakeEngine()
        eng = AsyncLLMEngine(fake)
        stream = await eng.add_request("hello", SamplingParams(max_tokens=5, n=2))
        outs = [out async for out in stream]
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        for i in range(2):
            deltas = "".join(o.outputs[i].delta_text for o in outs)
            assert deltas == outs[-1].outputs[i].text and len(deltas) == 5
        assert eng.num_unfinished == 0 and not fake.requests
        await eng.shutdown()

    _run(main())


def test_concurrent_requests_interleave_and_finish() -> None:
    async def main() -> None:
        eng = AsyncLLMEngine(FakeEngine())
        streams = [
            await eng.add_request(f"p{i}", SamplingParams(max_tokens=3 + i)) for i in range(8)
        ]

        async def consume(s):  # noqa: ANN001, ANN202
            return [o async for o in s]

        results = await asyncio.gather(*(consume(s) for s in streams))
        for i, outs in enumerate(results):
            assert len(outs[-1].outputs[0].token_ids) == 3 + i
        await eng.shutdown()

    _run(main())


def test_abort_frees_request_in_engine() -> None:
    async def main() -> None:
        fake = FakeEngine(step_seconds=0.005)
        eng = AsyncLLMEngine(fake)
        stream = await eng.add_request("abc", SamplingParams(max_tokens=200))
        first = await stream.__anext__()
        assert not first.finished
        stream.abort()
        stream.abort()  # idempotent
        await eng.run_in_engine(lambda: None)  # the abort ran before this (FIFO)
        assert not fake.requests and fake.num_aborted == 1
        assert eng.num_unfinished == 0
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        # the engine keeps serving
        again = await eng.add_request("abc", SamplingParams(max_tokens=2))
        assert [o async for o in again][-1].finished
        await eng.shutdown()

    _run(main())


def test_cancelled_consumer_aborts_via_finally() -> None:
    async def main() -> None:
        fake = FakeEngine(step_seconds=0.005)
        eng = AsyncLLMEngine(fake)
        stream = await eng.add_request("abc", SamplingParams(max_tokens=200))

        async def consume() -> None:
            try:
                async for _ in stream:
                    pass
            finally:
                stream.abort()

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await eng.run_in_engine(lambda: None)
        assert not fake.requests
        await eng.shutdown()

    _run(main())


def test_invalid_request_raises_and_queues_nothing() -> None:
    async def main() -> None:
        fake = FakeEngine(max_model_len=16)
        eng = AsyncLLMEngine(fake)
        with pytest.raises(ValueError, match="max_model_len"):
            await eng.add_request("x" * 10, SamplingParams(max_tokens=10))
        with pytest.raises(ValueError, match="empty"):
            await eng.add_request([], SamplingParams())
        assert eng.num_unfinished == 0 and not fake.requests
        stream = await eng.add_request("ok", SamplingParams(max_tokens=2))
        assert [o async for o in stream][-1].finished
        await eng.shutdown()

    _run(main())


def test_queue_bound_rejects_at_once() -> None:
    async def main() -> None:
        fake = FakeEngine(step_seconds=0.05)
        eng = AsyncLLMEngine(fake, max_queued_requests=2)
        # Hold the engine thread so nothing gets its first output yet.
        blocker = asyncio.ensure_future(eng.run_in_engine(lambda: __import__("time").sleep(0.3)))
        await asyncio.sleep(0.01)
        adds = [
            asyncio.ensure_future(eng.add_request(f"q{i}", SamplingParams(max_tokens=2)))
            for i in range(2)
        ]
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError):
            await eng.add_request("q2", SamplingParams(max_tokens=2))
        await blocker
        streams = await asyncio.gather(*adds)
        for s in streams:
            assert [o async for o in s][-1].finished
        # queue drained: accepted again
        s = await eng.add_request("q3", SamplingParams(max_tokens=2))
        assert [o async for o in s][-1].finished
        await eng.shutdown()

    _run(main())


def test_dead_loop_fails_pending_and_new_requests() -> None:
    async def main() -> None:
        fake = FakeEngine(step_seconds=0.005)
        eng = AsyncLLMEngine(fake)
        stream = await eng.add_request("abc", SamplingParams(max_tokens=100))
        await stream.__anext__()
        fake.fail_next_step = True
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert eng.is_dead
        with pytest.raises(EngineDeadError):
            await eng.add_request("abc", SamplingParams(max_tokens=2))
        await eng.shutdown()

    _run(main())


def test_engine_built_and_stepped_on_one_thread() -> None:
    """build_on_engine_thread: the engine is made on the thread that later steps it."""
    import threading

    from kvserve.engine.async_engine import build_on_engine_thread

    seen: dict[str, set[int]] = {"build": set(), "step": set()}

    class RecordingEngine(FakeEngine):
        def __init__(self) -> None:
            seen["build"].add(threading.get_ident())
            super().__init__()

        def step(self):  # noqa: ANN201 - the fake's own signature
            seen["step"].add(threading.get_ident())
            return super().step()

    async def main() -> None:
        engine, executor = build_on_engine_thread(RecordingEngine)
        eng = AsyncLLMEngine(engine, executor=executor)
        stream = await eng.add_request("hello", SamplingParams(max_tokens=3))
        assert [o async for o in stream][-1].finished
        await eng.shutdown()

    _run(main())
    assert len(seen["build"]) == 1 and seen["build"] == seen["step"]
    assert seen["build"] != {threading.get_ident()}  # not the caller's thread


def test_a_failing_build_raises_to_the_caller() -> None:
    from kvserve.engine.async_engine import build_on_engine_thread

    def broken() -> FakeEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        build_on_engine_thread(broken)


def test_late_abort_of_a_finished_stream_spares_a_new_request_with_its_id() -> None:
    """A stream whose final output its consumer never read is aborted (a disconnect) after
    its id was reused: the new request with that id runs on and finishes."""

    async def main() -> None:
        fake = FakeEngine()
        eng = AsyncLLMEngine(fake)
        old = await eng.add_request("abc", SamplingParams(max_tokens=1), request_id="x")
        await eng.run_in_engine(lambda: None)  # the step that finishes "x" was submitted
        while eng.num_unfinished:  # "x"'s final output is queued, not read
            await asyncio.sleep(0)
        assert not old.finished
        new = await eng.add_request("abc", SamplingParams(max_tokens=3), request_id="x")
        old.abort()
        outs = [o async for o in new]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        assert fake.num_aborted == 0 and eng.num_unfinished == 0
        await eng.shutdown()

    _run(main())


def test_add_cancelled_while_the_engine_adds_it_leaves_no_request_behind() -> None:
    """The caller of add_request is cancelled (a client disconnect) while the engine thread
    is adding the request: the request does not stay in the engine with nobody to read it."""
    import threading

    adding, release = threading.Event(), threading.Event()

    class SlowAdd(FakeEngine):
        def add_request(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            adding.set()
            release.wait(10)
            return super().add_request(*args, **kwargs)

    async def main() -> None:
        fake = SlowAdd()
        eng = AsyncLLMEngine(fake)
        task = asyncio.ensure_future(eng.add_request("abc", SamplingParams(max_tokens=200)))
        while not adding.is_set():
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await eng.run_in_engine(lambda: None)  # after the add (and any abort) on the thread
        assert not fake.requests and eng.num_unfinished == 0
        await eng.shutdown()

    _run(main())
