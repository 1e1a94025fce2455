"""Priority preemption through the real engine (``scheduling_policy="priority"``).

A pool too small for two requests at once: a low-priority request runs, a high-priority one
arrives later and preempts it (by recompute); the high-priority request finishes first, and
the preempted one still completes with the greedy tokens it gets when run alone. With the
default ``fcfs`` policy the late request waits instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model

BLOCK_SIZE = 4
# NOTE: each request needs (24 + 16) / 4 = 10 blocks by its end; 12 blocks hold one whole
# request. Once low has run a few steps (7 blocks), high's prompt (6 blocks) does not fit
# beside it: the late request gets in only by taking low's blocks.
NUM_BLOCKS = 12
LOW = [400 + 3 * j for j in range(24)]
HIGH = [900 + 5 * j for j in range(24)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def _engine(model_dir: Path, policy: str) -> LLMEngine:
    return LLMEngine(
        model=str(model_dir),
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_BLOCKS,
        max_model_len=64,
        num_threads=1,
        scheduling_policy=policy,
        enable_prefix_caching=False,
    )


@pytest.fixture(scope="module")
def alone(model_dir: Path) -> dict[str, list[int]]:
    """The greedy tokens of each prompt run alone (nobody to preempt it)."""
    out = {}
    for name, prompt in (("low", LOW), ("high", HIGH)):
        engine = _engine(model_dir, "priority")
        engine.add_request(prompt, PARAMS, request_id=name)
        out[name] = _run(engine)[name].outputs[0].token_ids
        assert engine.stats()["preemptions"] == 0
    return out


def _run(engine: LLMEngine, order: list[str] | None = None) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
                if order is not None:
                    order.append(out.request_id)
        engine.kv_cache_manager.check_integrity()
    assert not engine.has_unfinished_requests()
    return finals


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_late_high_priority_request_preempts_a_running_low_priority_one(
    model_dir: Path, alone: dict[str, list[int]], policy: str
) -> None:
    engine = _engine(model_dir, policy)
    engine.add_request(LOW, PARAMS, request_id="low", priority=1)
    for _ in range(4):  # low's prefill and a few decode steps
        engine.step()
    low = engine.scheduler.get_request("low")
    assert low is not None and low.num_output_tokens == 4
    assert engine.kv_cache_manager.num_free_blocks < 6  # high's prompt does not fit
    engine.add_request(HIGH, PARAMS, request_id="high", priority=0)
    order: list[str] = []
    finals = _run(engine, order)
    stats = engine.stats()
    if policy == "priority":
        assert stats["priority_preemptions"] == 1 and low.num_preemptions == 1
        assert order == ["high", "low"]  # the late, more important request went first
    else:
        assert stats["priority_preemptions"] == 0 and stats["preemptions"] == 0
        assert order == ["low", "high"]  # it waited for low's blocks
    # Both complete, with the tokens each gets alone (the preempted one recomputed its
    # prompt and kept its output tokens).
    assert finals["low"].error is None and finals["high"].error is None
    assert finals["low"].outputs[0].token_ids == alone["low"]
    assert finals["high"].outputs[0].token_ids == alone["high"]
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
