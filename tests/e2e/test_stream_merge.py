"""The real engine's outputs merge exactly in a RequestStream nobody reads: n=2 (a forked
sample starts a step late), logprobs, prompt logprobs and a stop string that holds text back
(tiny model)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import pytest

from kvserve.engine.async_engine import AsyncLLMEngine, RequestStream
from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return LLMEngine(model=str(model_dir), num_kv_blocks=64, max_model_len=128, num_threads=1)


def _params(**extra: object) -> SamplingParams:
    return SamplingParams(
        n=2, seed=7, max_tokens=30, logprobs=2, prompt_logprobs=1, ignore_eos=True, **extra
    )


def _steps(engine: LLMEngine, params: SamplingParams, stream: RequestStream | None = None) -> list:
    """Every output of one request, one per step, as a reader of each step gets it (copies);
    the outputs themselves go to ``stream`` if given."""
    rid = engine.add_request(PROMPT, params)
    outs = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                outs.append(copy.deepcopy(out))
                if stream is not None:
                    stream.put(out)
    return outs


def _joined(steps: list[RequestOutput]) -> RequestOutput:
    """What reading ``steps`` at once must give: the last one, each sample's deltas those of
    all the steps."""
    want = copy.deepcopy(steps[-1])
    for c in want.outputs:
        c.delta_text = "".join(o.outputs[c.index].delta_text for o in steps)
        c.delta_token_ids = [t for o in steps for t in o.outputs[c.index].delta_token_ids]
    return want


def test_unread_outputs_of_the_engine_merge_exactly(engine: LLMEngine) -> None:
    # A stop string inside sample 0's text: it stops there, and its text is held back while
    # the stop string could be starting.
    text = _steps(engine, _params())[-1].outputs[0].text
    params = _params(stop=[text[20:24]])
    stream = RequestStream("r", lambda s: None)
    steps = _steps(engine, params, stream)
    assert [c.finish_reason for c in steps[-1].outputs] == ["stop", "length"]
    assert any(c.delta_token_ids and not c.delta_text for o in steps for c in o.outputs)
    assert steps[0].outputs[1].delta_token_ids == []  # the forked sample starts a step late
    assert stream.num_pending == 1 and stream.num_received == len(steps) > 1

    async def read() -> list[RequestOutput]:
        return [o async for o in stream]

    (merged,) = asyncio.run(read())
    # every field: text, token ids, logprobs, finish and stop reasons, metrics, prompt
    # logprobs, cached tokens; the deltas joined
    assert dataclasses.asdict(merged) == dataclasses.asdict(_joined(steps))
    for c in merged.outputs:
        assert c.delta_text == c.text and c.delta_token_ids == c.token_ids


def test_a_stalled_reader_of_the_async_engine_gets_what_a_reader_got(engine: LLMEngine) -> None:
    """Through AsyncLLMEngine: a request read at every output, then the same request (same
    seed, another cache salt) left unread until it has finished: one output, holding what the
    reader got in total."""

    async def main() -> tuple[list[RequestOutput], RequestStream, RequestOutput]:
        async_engine = AsyncLLMEngine(engine)
        try:
            reader = await async_engine.add_request(PROMPT, _params(), cache_salt="a")
            read = [o async for o in reader]
            stalled = await async_engine.add_request(PROMPT, _params(), cache_salt="b")
            while async_engine.num_unfinished:
                await asyncio.sleep(0.005)
            assert stalled.num_pending == 1 and stalled.num_received == reader.num_received
            (merged,) = [o async for o in stalled]
            return read, stalled, merged
        finally:
            await async_engine.shutdown()

    read, stalled, merged = asyncio.run(asyncio.wait_for(main(), timeout=300))
    assert stalled.num_outputs == 1 and merged.finished
    last = read[-1]
    for got, want in zip(merged.outputs, last.outputs, strict=True):
        assert (got.text, got.token_ids, got.logprobs, got.finish_reason) == (
            want.text,
            want.token_ids,
            want.logprobs,
            want.finish_reason,
        )
        assert got.cumulative_logprob == want.cumulative_logprob
        assert got.delta_text == "".join(o.outputs[got.index].delta_text for o in read)
        assert got.delta_token_ids == [
            t for o in read for t in o.outputs[got.index].delta_token_ids
        ]
    assert merged.prompt_logprobs == last.prompt_logprobs
