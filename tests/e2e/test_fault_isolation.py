"""Per-request fault isolation through the real engine on a tiny random-weight Llama.

A runner that raises on chosen steps for chosen requests: those requests fail (their output
carries the error), every other request finishes with exactly the tokens of an unfaulted
run, the KV manager's integrity holds after every step and no block leaks. A fault every
request hits alone stops the engine (StepFault). Hypothesis drives SamplingParams through
the engine: accepted parameters always give in-vocabulary tokens, never a dead engine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.step_guard import StepFault
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from tests.e2e.engine_steps import drain
from tests.tiny_models import make_tiny_model

BLOCK_SIZE = 4
SHARED = [300 + 7 * j for j in range(9)]  # a prefix several prompts share (2 full blocks)
PROMPTS = [SHARED + [1000 + 13 * i + j for j in range(1 + i % 4)] for i in range(8)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def _engine(model_dir: Path, **kwargs: object) -> LLMEngine:
    kwargs.setdefault("num_threads", 1)
    kwargs.setdefault("num_kv_blocks", 96)
    return LLMEngine(model=str(model_dir), block_size=BLOCK_SIZE, max_model_len=64, **kwargs)


class FaultyRunner:
    """Wraps ``runner.execute``: raises when a chosen request runs in a chosen engine step."""

    def __init__(
        self, execute: Callable[[SchedulerOutput], ModelRunnerOutput], step: Callable[[], int]
    ) -> None:
        self.execute_real = execute
        self.step = step
        self.faults: set[tuple[int, str]] = set()  # (engine step, request id)
        self.num_raised = 0

    def __call__(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        now = self.step()
        for sr in sched.scheduled:
            if (now, sr.request_id) in self.faults:
                self.num_raised += 1
                raise RuntimeError(f"injected fault: {sr.request_id} at step {now}")
        return self.execute_real(sched)


def _run_all(engine: LLMEngine, n_of: Callable[[int], int]) -> dict[str, RequestOutput]:
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=0.0, max_tokens=6 + i, ignore_eos=True, n=n_of(i))
        engine.add_request(prompt, params, request_id=f"r{i}")
    return drain(engine)


def _assert_no_leak(engine: LLMEngine) -> None:
    kv = engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    # NOTE: nothing per request outlives it (a long-running server's memory stays flat).
    assert engine.num_request_states == 0


def _n_of(i: int) -> int:
    return 2 if i in (3, 6) else 1


def test_injected_faults_fail_only_their_requests(model_dir: Path) -> None:
    expected = _run_all(_engine(model_dir), _n_of)
    engine = _engine(model_dir)
    faulty = FaultyRunner(engine.runner.execute, lambda: engine.num_steps)
    # r1 during its prefill, r4 while decoding, r6's second sample (a fork) while decoding.
    faulty.faults = {(0, "r1"), (3, "r4"), (4, "r6#1")}
    engine.runner.execute = faulty  # type: ignore[method-assign]
    got = _run_all(engine, _n_of)
    assert faulty.num_raised >= 3
    failed = {rid for rid, out in got.items() if out.error is not None}
    assert failed == {"r1", "r4", "r6"}
    for rid in failed:
        assert "injected fault" in (got[rid].error or "")
    for rid, out in got.items():
        if rid not in failed:
            assert out.error is None
            assert [c.token_ids for c in out.outputs] == [
                c.token_ids for c in expected[rid].outputs
            ], rid
    assert engine.stats()["num_failed_requests"] == 3
    _assert_no_leak(engine)
    # The engine serves on: a request with r1's prompt (whose blocks never got written)
    # gives the unfaulted tokens.
    again = _run_all(engine, _n_of)
    assert all(out.error is None for out in again.values())
    assert [c.token_ids for c in again["r1"].outputs] == [
        c.token_ids for c in expected["r1"].outputs
    ]
    _assert_no_leak(engine)


def test_a_fault_of_the_request_writing_a_shared_prefix_fails_its_readers(
    model_dir: Path,
) -> None:
    expected = _run_all(_engine(model_dir), _n_of)
    engine = _engine(model_dir)
    faulty = FaultyRunner(engine.runner.execute, lambda: engine.num_steps)
    faulty.faults = {(0, "r0")}  # r0 computes the shared prefix the others hit in that step
    engine.runner.execute = faulty  # type: ignore[method-assign]
    got = _run_all(engine, _n_of)
    readers = {rid for rid, out in got.items() if out.error and "prefix-cache hit" in out.error}
    assert "injected fault" in (got["r0"].error or "") and readers
    for rid, out in got.items():
        if out.error is None:  # never the tokens of KV that was not written
            assert [c.token_ids for c in out.outputs] == [
                c.token_ids for c in expected[rid].outputs
            ], rid
    _assert_no_leak(engine)
    again = _run_all(engine, _n_of)
    assert {rid: [c.token_ids for c in o.outputs] for rid, o in again.items()} == {
        rid: [c.token_ids for c in o.outputs] for rid, o in expected.items()
    }
    _assert_no_leak(engine)


def test_fault_of_every_request_stops_the_engine(model_dir: Path) -> None:
    engine = _engine(model_dir)

    def broken(_sched: SchedulerOutput) -> ModelRunnerOutput:
        raise RuntimeError("the device is gone")

    engine.runner.execute = broken  # type: ignore[method-assign]
    for i in range(3):
        engine.add_request(PROMPTS[i], SamplingParams(max_tokens=4), request_id=f"r{i}")
    with pytest.raises(StepFault, match="every one of the step's 3 requests"):
        engine.step()


def test_nonfinite_logits_fail_that_request_only(model_dir: Path) -> None:
    engine = _engine(model_dir)
    model = engine.runner.model
    real = model.compute_logits
    poisoned_rows = {"count": 0}

    def compute_logits(hidden, keep_dtype=False):  # noqa: ANN001, ANN202 - the model's own
        logits = real(hidden, keep_dtype=keep_dtype)
        if logits.shape[0] > 1 and poisoned_rows["count"] == 0:
            poisoned_rows["count"] += 1
            logits[1, 5] = float("nan")  # the second sampling row of the first batch
        return logits

    model.compute_logits = compute_logits  # type: ignore[method-assign]
    for i in range(3):
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        engine.add_request(PROMPTS[i], params, request_id=f"r{i}")
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["r1"].error == "the model produced non-finite logits"
    assert finals["r0"].error is None and len(finals["r0"].outputs[0].token_ids) == 3
    assert finals["r2"].error is None and len(finals["r2"].outputs[0].token_ids) == 3
    _assert_no_leak(engine)


class FaultAfterSampling:
    """Wraps ``runner.execute``: runs the real step (every row sampled), then raises when a
    chosen request is in the batch at a chosen engine step: the failed attempt has drawn."""

    def __init__(
        self, execute: Callable[[SchedulerOutput], ModelRunnerOutput], step: Callable[[], int]
    ) -> None:
        self.execute_real = execute
        self.step = step
        self.faults: set[tuple[int, str]] = set()
        self.num_raised = 0

    def __call__(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        out = self.execute_real(sched)
        now = self.step()
        for sr in sched.scheduled:
            if (now, sr.request_id) in self.faults:
                self.num_raised += 1
                raise RuntimeError(f"injected fault after sampling: {sr.request_id}")
        return out


def test_seeded_request_in_a_faulted_step_draws_as_in_a_fault_free_run(model_dir: Path) -> None:
    def run(faults: set[tuple[int, str]]) -> tuple[dict[str, RequestOutput], int]:
        engine = _engine(model_dir)
        faulty = FaultAfterSampling(engine.runner.execute, lambda: engine.num_steps)
        faulty.faults = faults
        engine.runner.execute = faulty  # type: ignore[method-assign]
        for i in range(4):
            # r0 and r2 seeded (r2 with n=2: its second sample draws with seed + 1).
            seeded = i in (0, 2)
            params = SamplingParams(
                temperature=1.0, max_tokens=8, ignore_eos=True, n=2 if i == 2 else 1,
                seed=100 + i if seeded else None,
            )  # fmt: skip
            engine.add_request(PROMPTS[i], params, request_id=f"r{i}")
        finals: dict[str, RequestOutput] = {}
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        _assert_no_leak(engine)
        return finals, faulty.num_raised

    expected, _ = run(set())
    # r1 fails in its prefill step and r3 in a decode step, each after the whole batch
    # (the seeded r0 and r2 among it) has drawn; bisection runs the others again.
    got, num_raised = run({(0, "r1"), (3, "r3")})
    assert num_raised >= 2
    assert got["r1"].error and got["r3"].error
    for rid in ("r0", "r2"):
        assert got[rid].error is None
        assert [c.token_ids for c in got[rid].outputs] == [
            c.token_ids for c in expected[rid].outputs
        ], rid


@pytest.fixture(scope="module")
def fuzz_engine(model_dir: Path) -> LLMEngine:
    return _engine(model_dir, seed=3)


_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1e-45, 1e-40, 1e-7, 1e-6, 1e-5, 0.5, 1.0, 2.0, 1e6, 1e7, 3.5e38]),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    temperature=_floats,
    top_p=_floats,
    top_k=st.integers(-2, 60000),
    min_p=_floats,
    repetition_penalty=_floats,
    presence_penalty=_floats,
    frequency_penalty=_floats,
    min_tokens=st.integers(0, 4),
    n=st.integers(1, 3),
    seed=st.one_of(st.none(), st.integers(0, 2**31)),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
)
def test_accepted_sampling_params_never_break_the_engine(
    fuzz_engine: LLMEngine, **kwargs: object
) -> None:
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True, **kwargs)  # type: ignore[arg-type]
    except ValueError as e:
        assert str(e).startswith("SamplingParams.")  # a clean error naming the field
        return
    engine = fuzz_engine
    rid = engine.add_request(PROMPTS[0], params)
    final = None
    for _ in range(50):
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
        if final is not None:
            break
    assert final is not None and final.error is None, final
    vocab = engine.arch.vocab_size
    for c in final.outputs:
        assert len(c.token_ids) == 4 and all(0 <= t < vocab for t in c.token_ids)
    _assert_no_leak(engine)


def test_no_request_state_outlives_its_request(model_dir: Path) -> None:
    engine = _engine(model_dir)
    faulty = FaultyRunner(engine.runner.execute, lambda: engine.num_steps)
    faulty.faults = {(1, "r1")}
    engine.runner.execute = faulty  # type: ignore[method-assign]
    for i in range(4):
        params = SamplingParams(temperature=0.8, max_tokens=6, n=2 if i == 2 else 1, seed=i)
        engine.add_request(PROMPTS[i], params, request_id=f"r{i}")
    engine.step()
    assert engine.num_request_states == 4 + 5  # 4 groups, 5 samples
    engine.abort_request("r3")
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert faulty.num_raised >= 1
    _assert_no_leak(engine)
