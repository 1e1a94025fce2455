"""Fault injection for tests and the soak benchmark (``kvserve serve --debug-inject-faults``).

``FaultInjector`` wraps a model runner's ``execute``. A request whose prompt text contains
``REQUEST_FAULT_MARKER`` makes every step it runs in raise (the engine's fault
isolation must pin the fault on it alone); one containing ``FATAL_FAULT_MARKER`` raises
StepFault (a fault no request can be blamed for: the engine stops, the server exits 1); one
containing ``SLOW_STEP_MARKER`` makes every step it runs in take at least ``SLOW_STEP_S``
(a stream that outlasts a drain deadline on any machine). Never enabled by default.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvserve.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from kvserve.engine.step_guard import StepFault

REQUEST_FAULT_MARKER = "KVSERVE_INJECT_FAULT"
FATAL_FAULT_MARKER = "KVSERVE_INJECT_FATAL"
SLOW_STEP_MARKER = "KVSERVE_INJECT_SLOW"
SLOW_STEP_S = 0.02


class InjectedFault(RuntimeError):
    """Raised by FaultInjector for a request that asked for it."""


class FaultInjector:
    """Wraps ``execute`` (see the module docstring)."""

    def __init__(
        self,
        execute: Callable[[SchedulerOutput], ModelRunnerOutput],
        decode: Callable[[list[int]], str],
    ) -> None:
        self.execute_real = execute
        self.decode = decode
        self._verdict: dict[str, str | None] = {}  # request id -> fault/fatal/slow/None
        self.num_injected = 0

    def __call__(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in sched.finished_req_ids:
            self._verdict.pop(request_id, None)
        slow = False
        for sr in sched.scheduled:
            verdict = self._judge(sr)
            slow = slow or verdict == "slow"
            if verdict == "fatal":
                self.num_injected += 1
                raise StepFault(f"injected fatal fault (request {sr.request_id})")
            if verdict == "fault":
                self.num_injected += 1
                raise InjectedFault(f"injected fault for request {sr.request_id}")
        if slow:
            time.sleep(SLOW_STEP_S)
        return self.execute_real(sched)

    def _judge(self, sr: ScheduledRequest) -> str | None:
        if sr.request_id not in self._verdict:
            # NOTE: decoded once per request (tokens of a marker depend on its context).
            text = self.decode(sr.prompt_token_ids)
            verdict = None
            if FATAL_FAULT_MARKER in text:
                verdict = "fatal"
            elif REQUEST_FAULT_MARKER in text:
                verdict = "fault"
            elif SLOW_STEP_MARKER in text:
                verdict = "slow"
            self._verdict[sr.request_id] = verdict
        return self._verdict[sr.request_id]


def install(engine: object) -> FaultInjector:
    """Wrap ``engine.runner.execute`` of an LLMEngine with a FaultInjector; returns it."""
    runner = engine.runner  # type: ignore[attr-defined]
    tokenizer = engine.tokenizer  # type: ignore[attr-defined]
    injector = FaultInjector(runner.execute, lambda ids: tokenizer.decode(ids))
    runner.execute = injector
    return injector
