"""``kvserve bench spec --draft-model``: the speculative engine's config it builds."""

from __future__ import annotations

import json

from kvserve.bench.spec import DEFAULT_SPEC, draft_spec_config, step_ms_by_rows
from kvserve.spec_config import SpeculativeConfig


def test_draft_model_replaces_the_ngram_keys() -> None:
    assert draft_spec_config(DEFAULT_SPEC, None) == DEFAULT_SPEC
    got = json.loads(draft_spec_config(DEFAULT_SPEC, "/m/draft.gguf"))
    assert got == {"num_speculative_tokens": 4, "model": "/m/draft.gguf"}
    config = SpeculativeConfig.parse(draft_spec_config('{"adaptive": false}', "/m/d"))
    assert config is not None and config.method == "draft_model" and not config.adaptive


def test_step_ms_by_rows_takes_the_one_request_steps_median() -> None:
    def rec(prefill: int, decode: int, seqs: int, ms: float) -> dict[str, float]:
        return {
            "num_prefill_tokens": prefill,
            "num_decode_tokens": decode,
            "num_seqs": seqs,
            "execute_seconds": ms / 1e3,
        }

    records = [
        rec(0, 1, 1, 6.0),
        rec(0, 1, 1, 8.0),
        rec(0, 1, 1, 7.0),
        rec(5, 0, 1, 15.0),  # one request verifying 4 drafts: 5 positions
        rec(5, 1, 2, 99.0),  # two requests: left out
        rec(40, 0, 1, 50.0),  # a prompt of 40: past max_rows
    ]
    assert step_ms_by_rows(records) == {1: 7.0, 5: 15.0}
    assert step_ms_by_rows(records, max_rows=40) == {1: 7.0, 5: 15.0, 40: 50.0}
