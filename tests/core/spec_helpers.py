"""Speculative decoding over the FakeRunner: a runner that verifies drafts, and proposers.

``SpecFakeRunner`` verifies a scheduled request's drafts as the real runner does
(``runtime/spec_verify.py``): it writes the simulated K/V of the known token and of every
draft through the block table, samples the fake model after each of them and accepts drafts
while they equal its samples. ``OracleSpeculator`` proposes drafts from the fake model itself
(the first ``good`` right, the rest wrong), so tests choose how many are accepted.
``DraftModelFakeRunner`` plays a draft model: it fills the scheduler's placeholders the same
way, in the runner, as ``runtime/draft_runner.py`` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvserve.core.outputs import (
    DRAFT_PLACEHOLDER_TOKEN_ID,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from kvserve.core.sched.speculate import Speculator
from kvserve.request import Request
from tests.core.fake_runner import FakeRunner, mix, next_token, prefix_state, sample_from


class SpecFakeRunner(FakeRunner):
    """``FakeRunner`` plus draft verification (see the module docstring)."""

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        plain = [sr for sr in sched.scheduled if not sr.spec_token_ids]
        spec = [sr for sr in sched.scheduled if sr.spec_token_ids]
        sched.scheduled = plain
        out = super().execute(sched)
        sched.scheduled = plain + spec
        for sr in spec:
            self._verify(sr, out)
        return out

    def _verify(self, sr: ScheduledRequest, out: ModelRunnerOutput) -> None:
        known = sr.prompt_token_ids + sr.output_token_ids
        start, drafts = sr.start_pos, sr.spec_token_ids
        assert start == len(known) - 1 and sr.sample, f"{sr.request_id}: drafts off a decode"
        assert sr.token_ids == [known[start], *drafts]
        assert len(sr.block_ids) * self.block_size >= start + len(sr.token_ids)
        b, o = self._slot(sr.block_ids, start - 1)
        state = self.device[b][o]
        assert state == prefix_state(known[:start]), f"{sr.request_id}: cached prefix wrong"
        samples = []
        for pos, token in enumerate(sr.token_ids, start):
            state = mix(state, token)
            b, o = self._slot(sr.block_ids, pos)
            self.device[b][o] = state
            samples.append(sample_from(state, sr.seed, self.vocab_size))
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == samples[accepted]:
            accepted += 1
        out.sampled_token_ids[sr.request_id] = samples[accepted]
        out.spec_num_accepted[sr.request_id] = accepted


class OracleSpeculator(Speculator):
    """Drafts from the fake model: ``good(request)`` right tokens, then wrong ones."""

    def __init__(
        self, *args: object, vocab_size: int, good: Callable[[Request], int], **kwargs: object
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.vocab_size = vocab_size
        self.good = good
        self.proposed = 0

    def propose(self, request: Request, k: int) -> list[int]:
        params = request.sampling_params
        seed = None if params.seed is None else params.seed + request.sample_index
        tokens = request.all_token_ids
        drafts: list[int] = []
        num_good = self.good(request)
        for i in range(k):
            token = next_token(tokens, seed, self.vocab_size)
            if i >= num_good:
                token = (token + 1) % self.vocab_size  # wrong on purpose
            drafts.append(token)
            tokens.append(token)
        self.proposed += 1
        return drafts


class DraftModelFakeRunner(SpecFakeRunner):
    """``SpecFakeRunner`` with a draft model: it replaces the scheduler's placeholders
    (``DRAFT_PLACEHOLDER_TOKEN_ID``) by the fake model's next tokens, the first
    ``good(request_id, output_len)`` right and the rest wrong, on copies of the scheduled
    requests (the scheduler's stay as they were), and reports them in ``spec_token_ids``."""

    def __init__(self, *args: object, good: Callable[[str, int], int], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.good = good
        self.filled = 0

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        scheduled = [self._fill(sr) for sr in sched.scheduled]
        out = super().execute(dataclasses.replace(sched, scheduled=scheduled))
        for sr in scheduled:
            if sr.spec_token_ids:
                out.spec_token_ids[sr.request_id] = sr.spec_token_ids
        return out

    def _fill(self, sr: ScheduledRequest) -> ScheduledRequest:
        k = len(sr.spec_token_ids)
        if not k:
            return sr
        assert sr.spec_token_ids == [DRAFT_PLACEHOLDER_TOKEN_ID] * k
        tokens = sr.prompt_token_ids + sr.output_token_ids
        num_good = self.good(sr.request_id, len(sr.output_token_ids))
        drafts: list[int] = []
        for i in range(k):
            token = next_token(tokens, sr.seed, self.vocab_size)
            token = token if i < num_good else (token + 1) % self.vocab_size
            drafts.append(token)
            tokens = tokens + [token]
        self.filled += 1
        return dataclasses.replace(sr, token_ids=sr.token_ids[:-k] + drafts, spec_token_ids=drafts)
