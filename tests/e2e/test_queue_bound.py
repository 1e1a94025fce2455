"""``max_queued_requests`` bounds the requests waiting for a seat, not the running ones: a
burst that fits in the free seats is accepted whole; ``n`` above max_num_seqs is a 400 naming
``n`` (real engine, tiny model)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from kvserve.engine.async_engine import AsyncLLMEngine, QueueFullError, build_on_engine_thread
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from kvserve.server.app import build_app
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


async def _burst(engine: AsyncLLMEngine, num: int) -> tuple[int, int]:
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)  # outlast the burst
    accepted, rejected = [], 0
    for i in range(num):  # all added before the loop can take a step
        try:
            accepted.append(await engine.add_request([100 + i, 7, 8], params))
        except QueueFullError:
            rejected += 1
    for stream in accepted:
        async for _ in stream:
            pass
    return len(accepted), rejected


@pytest.mark.parametrize(("max_num_seqs", "expect_accepted"), [(16, 12), (4, 6)])
def test_burst_is_bounded_by_waiting_requests_only(
    model_dir: Path, max_num_seqs: int, expect_accepted: int
) -> None:
    async def main() -> tuple[int, int]:
        engine, executor = build_on_engine_thread(
            lambda: LLMEngine(
                model=str(model_dir), num_kv_blocks=64, max_model_len=64, num_threads=1,
                max_num_seqs=max_num_seqs,
            )
        )  # fmt: skip
        async_engine = AsyncLLMEngine(engine, max_queued_requests=2, executor=executor)
        try:
            return await _burst(async_engine, 12)
        finally:
            await async_engine.shutdown()

    accepted, rejected = asyncio.run(asyncio.wait_for(main(), timeout=300))
    # 16 seats: 12 requests all find a seat. 4 seats: 4 seated + 2 waiting, 6 turned away.
    assert (accepted, rejected) == (expect_accepted, 12 - expect_accepted)


def test_n_above_max_num_seqs_is_a_400_naming_n(model_dir: Path) -> None:
    async def main() -> httpx.Response:
        engine, executor = build_on_engine_thread(
            lambda: LLMEngine(
                model=str(model_dir), num_kv_blocks=64, max_model_len=64, num_threads=1,
                max_num_seqs=4,
            )
        )  # fmt: skip
        app = build_app(engine, executor=executor)
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                return await client.post(
                    "/v1/completions", json={"prompt": "hi", "n": 5, "max_tokens": 2}
                )
        finally:
            await app.state.async_engine.shutdown()

    resp = asyncio.run(asyncio.wait_for(main(), timeout=300))
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "n" and "max_num_seqs=4" in err["message"]
