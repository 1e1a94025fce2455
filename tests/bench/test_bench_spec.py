"""``kvserve bench spec --draft-model``: the speculative engine's config it builds."""

from __future__ import annotations

import json

from kvserve.bench.spec import DEFAULT_SPEC, draft_spec_config
from kvserve.spec_config import SpeculativeConfig


def test_draft_model_replaces_the_ngram_keys() -> None:
    assert draft_spec_config(DEFAULT_SPEC, None) == DEFAULT_SPEC
    got = json.loads(draft_spec_config(DEFAULT_SPEC, "/m/draft.gguf"))
    assert got == {"num_speculative_tokens": 4, "model": "/m/draft.gguf"}
    config = SpeculativeConfig.parse(draft_spec_config('{"adaptive": false}', "/m/d"))
    assert config is not None and config.method == "draft_model" and not config.adaptive
